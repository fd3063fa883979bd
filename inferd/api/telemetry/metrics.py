"""GET /metrics: Prometheus text format through prometheus-client, one registry per app.

Nothing is counted here: at each scrape a collector turns the engine's latest published
`EngineSnapshot` (counters, per-class state and histograms the engine keeps without any
Prometheus import) into metric families. Label values come from configuration (class names,
the served model name, fixed reasons and kinds), never from request text, so cardinality is
bounded.

Autoscale on `inferd_queued_tokens` (work waiting, in the unit the engine consumes) and
`inferd_kv_usage_ratio` (memory pressure), not on CPU: an engine at full batch is busy whether
or not it keeps up, while queued tokens grow only when it does not.

Next to inferd's own names it serves the `vllm:` names that the Gateway API Inference Extension's
endpoint picker reads (its "model server protocol"), computed from the same snapshot: the picker
then routes to inferd pods as it does to vLLM's (docs/kubernetes.md has the mapping).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from inferd.api.admission.ask import GRAMMAR_KINDS
from inferd.api.admission.queues import REASONS
from inferd.api.conversation.volatile import VOLATILE, VolatileBlocks
from inferd.api.edge import EDGE, REFUSALS, EdgeCounts
from inferd.api.gateway.gate import GATEWAY, Gateway
from inferd.api.routing.registry import REGISTRY, ModelRegistry
from inferd.api.state import STATE, ServerState
from inferd.api.streaming.backpressure import SLOW_CLIENTS, SlowClientCounts
from inferd.api.streaming.resume import RESUMABLE, StreamRegistry
from inferd.api.telemetry.drift import DriftMonitor
from inferd.api.telemetry.loop_lag import LOOP_LAG, LoopLag
from inferd.api.telemetry.model_life import NOT_LOADED
from inferd.api.telemetry.request_file import REQUEST_JOURNAL
from inferd.api.telemetry.served_metrics import (buckets, drift_metrics, expert_metrics, model_metrics, summed,
                                                 tenant_metrics)
from inferd.engine.protocol import FAILURE_KINDS, ClassSnapshot, EngineLimits, EngineSnapshot
from inferd.settings.policy import TIMEOUT_KINDS

COLLECTORS = web.AppKey("metrics_registry", CollectorRegistry)
PREEMPTION_MODES = ("recompute", "swap")
LATENCIES = {  # histogram: (class stats field, help)
    "inferd_ttft_seconds": ("ttft", "Time from arrival to the first token."),
    "inferd_itl_seconds": ("itl", "Time between two consecutive tokens of a request."),
    "inferd_tpot_seconds": ("tpot", "Time per output token after the first, per finished request."),
    "inferd_e2e_seconds": ("e2e", "Time from arrival to the end of a request."),
    "inferd_queue_time_seconds": ("queue_time", "Time from arrival to first being scheduled."),
}


def _per_class(name: str, doc: str, kind: type, values: dict[str, float]) -> Metric:
    family = kind(name, doc, labels=["class"])
    for cls, value in values.items():
        family.add_metric([cls], value)
    return family


def _counter_by(name: str, doc: str, label: str, known: tuple[str, ...], values: dict[str, int]) -> Metric:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key in known:  # every known label value, at 0 too, so rate() works from the start
        family.add_metric([key], values.get(key, 0))
    return family


def _class_metrics(classes: tuple[ClassSnapshot, ...]) -> Iterator[Metric]:
    yield _per_class("inferd_requests_waiting", "Requests waiting to be scheduled.", GaugeMetricFamily,
                     {c.name: c.waiting for c in classes})
    yield _per_class("inferd_requests_running", "Requests (choices) running.", GaugeMetricFamily,
                     {c.name: c.running for c in classes})
    yield _per_class("inferd_queued_tokens", "Prompt tokens still to compute for waiting requests.",
                     GaugeMetricFamily, {c.name: c.queued_tokens for c in classes})
    yield _per_class("inferd_queued_token_seconds", "Queued prompt tokens integrated over time.",
                     CounterMetricFamily, {c.name: c.queued_token_seconds for c in classes})
    yield _per_class("inferd_oldest_wait_seconds", "How long the longest-waiting request has waited.",
                     GaugeMetricFamily, {c.name: c.oldest_wait for c in classes})
    yield _per_class("inferd_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).",
                     CounterMetricFamily, {c.name: c.prompt_tokens for c in classes})
    yield _per_class("inferd_generation_tokens", "Tokens generated.", CounterMetricFamily,
                     {c.name: c.generation_tokens for c in classes})
    yield _per_class("inferd_class_kv_blocks_used", "KV blocks in the tables of a class's running requests.",
                     GaugeMetricFamily, {c.name: c.kv_blocks_used for c in classes})
    misses = CounterMetricFamily("inferd_deadline_misses", "Requests past their class's soft target.",
                                 labels=["class", "kind"])
    for c in classes:
        for kind in ("ttft", "tpot"):
            misses.add_metric([c.name, kind], c.deadline_misses.get(kind, 0))
    yield misses


# a hybrid model's state slots (EngineSnapshot.state_slots): name, kind, help, the snapshot's field
STATE_METRICS = (
    ("inferd_state_slots_total", GaugeMetricFamily, "Recurrent-state slots (linear-attention layers).", "total"),
    ("inferd_state_slots_working", GaugeMetricFamily, "State slots held by running requests.", "working"),
    ("inferd_state_checkpoints", GaugeMetricFamily, "Prefix-cache state checkpoints held (evictable).", "checkpoints"),
    ("inferd_state_checkpoint_bytes", GaugeMetricFamily, "Bytes the state checkpoints hold.", "checkpoint_bytes"),
    ("inferd_state_checkpoint_hits", CounterMetricFamily, "Prompts that resumed from a state checkpoint.",
     "checkpoint_hits"),
    ("inferd_state_checkpoint_hit_tokens", CounterMetricFamily,
     "Prompt tokens skipped by resuming from a state checkpoint.", "checkpoint_hit_tokens"),
    ("inferd_state_checkpoint_evictions", CounterMetricFamily, "State checkpoints evicted for room.",
     "checkpoint_evictions"),
)

# speculative decoding (EngineSnapshot.speculation): name, help, the snapshot's field
SPEC_METRICS = (
    ("inferd_spec_drafted_tokens", "Draft tokens verified (speculative decoding).", "drafted_tokens"),
    ("inferd_spec_accepted_tokens", "Draft tokens accepted: handed out without a step of their own.",
     "accepted_tokens"),
    ("inferd_spec_verifications", "Decodes that verified drafts.", "verifications"),
    ("inferd_spec_steps_drafted", "Engine steps in which some request verified drafts.", "steps_drafted"),
    ("inferd_spec_steps_off", "Steps method auto ran without drafts (more requests decoding than its max_batch).",
     "steps_off"),
)


# the prefix cache's host tier and sessions (EngineSnapshot.cache_tiers): name, kind, help, the field
TIER_METRICS = (
    ("inferd_host_cache_blocks_total", GaugeMetricFamily, "Host-tier blocks of the prefix cache (kv_host_cache_memory).",
     "host_blocks_total"),
    ("inferd_host_cache_blocks_used", GaugeMetricFamily, "Host-tier blocks holding an evicted prefix block.",
     "host_blocks_used"),
    ("inferd_host_cache_hits", CounterMetricFamily, "Prompt tokens the host tier served (copied back).",
     "host_hit_tokens"),
    ("inferd_host_cache_offloaded_blocks", CounterMetricFamily, "Evicted KV blocks copied to the host tier.",
     "offloaded_blocks"),
    ("inferd_host_cache_dropped_blocks", CounterMetricFamily, "Evicted KV blocks the host tier had no room for.",
     "dropped_blocks"),
    ("inferd_cache_sessions", GaugeMetricFamily, "Sessions holding a prefix ahead of anonymous blocks.", "sessions"),
    ("inferd_cache_session_blocks", GaugeMetricFamily, "Prefix-cache blocks (keys) sessions hold.", "session_blocks"),
    ("inferd_cache_session_released_blocks", CounterMetricFamily,
     "Held blocks let go: a session's newer state, or its tenant's bound (session_share).", "session_released_blocks"),
)


def _cache_metrics(stats: EngineSnapshot) -> Iterator[Metric]:
    yield GaugeMetricFamily("inferd_kv_blocks_total", "KV cache blocks.", value=stats.kv_blocks_total)
    yield GaugeMetricFamily("inferd_kv_blocks_used", "KV cache blocks held by requests.", value=stats.kv_blocks_used)
    yield GaugeMetricFamily("inferd_kv_blocks_cached", "Prefix-cache blocks no request holds (evictable).",
                            value=stats.kv_blocks_cached)
    yield GaugeMetricFamily("inferd_kv_usage_ratio", "KV blocks held by requests / all KV blocks.",
                            value=stats.kv_usage_ratio)
    yield CounterMetricFamily("inferd_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                              value=stats.prefix_queries)
    yield CounterMetricFamily("inferd_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                              value=stats.prefix_hits)
    if (state := stats.state_slots) is not None:  # a hybrid model's linear-attention state
        for name, kind, doc, field in STATE_METRICS:
            yield kind(name, doc, value=getattr(state, field))
    if (tiers := stats.cache_tiers) is not None:
        for name, kind, doc, field in TIER_METRICS:
            yield kind(name, doc, value=getattr(tiers, field))
    if (spec := stats.speculation) is not None:
        for name, doc, field in SPEC_METRICS:
            yield CounterMetricFamily(name, doc, value=getattr(spec, field))

def _histograms(stats: EngineSnapshot, model: str) -> Iterator[Metric]:
    for name, (field, doc) in LATENCIES.items():
        family = HistogramMetricFamily(name, doc, labels=["class", "model"])
        for c in stats.classes:
            h = c.histograms[field]
            family.add_metric([c.name, model], buckets(h), h.total)
        yield family
    for name, h, doc in (("inferd_step_seconds", stats.step_seconds, "Duration of an engine step."),
                         ("inferd_batch_tokens", stats.batch_tokens, "Tokens computed in an engine step.")):
        family = HistogramMetricFamily(name, doc, labels=["model"])
        family.add_metric([model], buckets(h), h.total)
        yield family


def _fault_metrics(stats: EngineSnapshot) -> Iterator[Metric]:
    yield _counter_by("inferd_step_failures", "Engine failures, by kind: a step's forward, one request's own "
                      "processing, an out-of-memory event (retried smaller).", "kind", FAILURE_KINDS,
                      stats.step_failures)
    yield GaugeMetricFamily("inferd_engine_healthy", "1 unless the engine failed steps in a row recently.",
                            value=float(stats.healthy))
    yield GaugeMetricFamily("inferd_consecutive_step_failures", "Steps in a row whose forward failed.",
                            value=stats.consecutive_step_failures)
    yield GaugeMetricFamily("inferd_oom_events_last_minute", "Out-of-memory events in the last minute.",
                            value=stats.oom_events_last_minute)
    yield GaugeMetricFamily("inferd_token_budget", "Tokens per engine step now (halved after out of memory).",
                            value=stats.token_budget)


def _model_gauge(name: str, doc: str, model: str, value: float) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _picker_aliases(stats: EngineSnapshot, limits: EngineLimits, model: str, started: float) -> Iterator[Metric]:
    """vLLM's names for what the inference extension's endpoint picker scrapes (gauges, as vLLM
    has them). NOTE: aliases, not new measurements: each equals an inferd metric of this scrape."""
    yield _model_gauge("vllm:num_requests_waiting", "Alias: the sum of inferd_requests_waiting.", model,
                       sum(c.waiting for c in stats.classes))
    yield _model_gauge("vllm:num_requests_running", "Alias: the sum of inferd_requests_running.", model,
                       sum(c.running for c in stats.classes))
    # a fraction in [0, 1] despite "perc" (as in vLLM); gpu_ is the name pickers before v1.3 read
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        yield _model_gauge(name, "Alias: inferd_kv_usage_ratio.", model, stats.kv_usage_ratio)
    info = GaugeMetricFamily("vllm:cache_config_info", "Alias: cache.block_size and inferd_kv_blocks_total as "
                             "labels (the picker's prefix scorer reads them).", labels=["block_size", "num_gpu_blocks"])
    info.add_metric([str(limits.block_size), str(stats.kv_blocks_total)], 1)
    yield info
    # inferd serves no LoRA adapters: none running or waiting, room for none; the value is when
    # that set last changed (the picker takes the newest series), i.e. the server's start
    lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters: none (inferd serves one model).",
                             labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    lora.add_metric(["0", "", ""], started)
    yield lora


class EngineCollector(Collector):
    """The first model's engine (unlabelled, as a single-model server has always had them), the
    server's own counters, and every model's (`model_metrics`)."""

    def __init__(self, registry: ModelRegistry, gateway: Gateway, state: ServerState, slow: SlowClientCounts,
                 edge: EdgeCounts, lag: LoopLag, streams: StreamRegistry, drift: DriftMonitor | None = None) -> None:
        self.registry = registry
        self.drift = drift
        self.gateway = gateway
        self.state = state
        self.slow = slow
        self.edge = edge
        self.lag = lag
        self.streams = streams
        self._nvml = importlib.util.find_spec("pynvml") is not None
        self._started = time.time()  # wall clock: vllm:lora_requests_info's timestamp

    def collect(self) -> Iterator[Metric]:
        registry = self.registry
        lead = registry.lead  # (None: no model loaded now, every one on demand: zeros for an engine's figures)
        primary = lead.current if lead is not None else None
        stats = primary.engine.snapshot if primary is not None else NOT_LOADED
        yield from _class_metrics(stats.classes)
        yield from _cache_metrics(stats)
        yield from expert_metrics(stats.experts_routed)
        yield from _histograms(stats, self.state.model_name)
        yield _counter_by("inferd_preemptions", "Running requests preempted, by how.", "mode", PREEMPTION_MODES,
                          stats.preemptions)
        yield _counter_by("inferd_timeouts", "Requests ended by a timeout, by which.", "kind", TIMEOUT_KINDS,
                          stats.timeouts)
        yield _counter_by("inferd_rejections", "Requests refused at the door, by why (every model's).", "reason",
                          REASONS, summed(registry, lambda slot: slot.counts.door.rejections_by_reason()))
        yield _counter_by("inferd_structured_requests", "Requests held to a grammar, by where it came from "
                          "(response_format's type, or forced tool calls); invalid: refused, it did not compile "
                          "(every model's).", "kind", GRAMMAR_KINDS,
                          summed(registry, lambda slot: slot.counts.door.grammars))
        yield from tenant_metrics(self.gateway, [served.engine.snapshot for served in registry.served()])
        yield GaugeMetricFamily("inferd_shed_level", "Load shedding level (0 normal .. 3).", value=stats.shed_level)
        yield from _fault_metrics(stats)
        yield CounterMetricFamily("inferd_drain_cut_requests", "Requests still running when a drain ended.",
                                  value=self.state.drain_cut)
        slow = self.slow
        yield CounterMetricFamily("inferd_slow_client_pauses", "Streams paused: their client was not "
                                  "reading (send buffers full).", value=slow.paused)
        yield CounterMetricFamily("inferd_slow_client_cuts", "Streams cut: their client read nothing for "
                                  "server.slow_client_seconds.", value=slow.cut)
        yield _counter_by("inferd_http_refusals", "Requests the HTTP edge refused before reading their body "
                          "(or while it was late), by why.", "reason", REFUSALS, self.edge.refused)
        lag = HistogramMetricFamily("inferd_event_loop_lag_seconds", "How late the event loop's periodic timer "
                                    "fired: what every stream's next chunk and /health waited too.")
        lag.add_metric([], buckets(self.lag.histogram), self.lag.histogram.total)
        yield lag
        yield from self._device(stats)
        if self.drift is not None:
            yield from drift_metrics(self.drift)
        yield GaugeMetricFamily("inferd_resumable_streams", "Resumable streams held (attached or not).",
                                value=self.streams.held)
        yield GaugeMetricFamily("inferd_resumable_streams_detached", "Resumable streams whose client left, "
                                "running on or finished, within server.resume_grace_seconds.",
                                value=self.streams.detached)
        if primary is not None:
            yield from _picker_aliases(stats, primary.engine.limits, self.state.model_name, self._started)
        yield from model_metrics(registry)

    def _device(self, stats: EngineSnapshot) -> Iterator[Metric]:
        memory = stats.device_memory
        if memory is None:
            return
        yield GaugeMetricFamily("inferd_device_memory_used_bytes", "Device memory in use.", value=memory.used_bytes)
        yield GaugeMetricFamily("inferd_device_memory_total_bytes", "Device memory.", value=memory.total_bytes)
        if self._nvml:
            import pynvml  # nvidia-ml-py: optional

            pynvml.nvmlInit()
            lead = self.registry.lead  # (device memory is known: a model is loaded)
            device = lead.current.engine.limits.device if lead is not None and lead.current is not None else ""
            index = int(device.partition(":")[2] or 0)
            utilization = pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(index)).gpu
            yield GaugeMetricFamily("inferd_device_utilization_ratio", "GPU utilization (NVML).",
                                    value=utilization / 100)


class PromptCollector(Collector):
    """What the API changed in the prompts it was sent."""

    def __init__(self, volatile: VolatileBlocks) -> None:
        self.volatile = volatile

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("inferd_prompt_volatile_blocks", "Prompt blocks dropped before rendering: they "
                                  "matched cache.volatile_prompt_patterns.", value=self.volatile.dropped)


def setup_metrics(app: web.Application) -> None:
    registry = CollectorRegistry(auto_describe=False)
    journal = app.get(REQUEST_JOURNAL)
    registry.register(EngineCollector(app[REGISTRY], app[GATEWAY], app[STATE], app[SLOW_CLIENTS], app[EDGE],
                                      app[LOOP_LAG], app[RESUMABLE], None if journal is None else journal.drift))
    registry.register(PromptCollector(app[VOLATILE]))
    app[COLLECTORS] = registry
    app.router.add_get("/metrics", metrics)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[COLLECTORS])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
