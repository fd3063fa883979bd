"""The metric families of what the server serves, for /metrics (metrics.py's collector): per tenant
(accounts, fair shares), per model (its door, degradation, routes' shares) and the traffic's drift.
Labels come from configuration only: tenant, model and route names, fixed reasons and kinds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from inferd.api.admission.ask import GRAMMAR_KINDS
from inferd.api.admission.queues import REASONS
from inferd.api.gateway.gate import GATEWAY_REASONS, Gateway
from inferd.api.routing.registry import ModelRegistry, ModelSlot
from inferd.api.telemetry.drift import SCRIPTS, DriftMonitor
from inferd.api.telemetry.model_life import lifecycle_metrics
from inferd.engine.protocol import EngineSnapshot, Histogram


def buckets(h: Histogram) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs, +Inf last, as HistogramMetricFamily wants them."""
    out, running = [], 0
    for bound, count in zip((*h.bounds, float("inf")), h.counts):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return out



def tenant_metrics(gateway: Gateway, snapshots: list[EngineSnapshot]) -> Iterator[Metric]:
    """Per tenant, labelled with configured names only (never a key or its digest); its fair
    share summed over every model's engine."""
    names = list(gateway.accounts)  # every tenant configured since start: counters never vanish
    accounts = gateway.accounts
    fair: dict[str | None, dict[str, float]] = {}
    for stats in snapshots:
        for t in stats.tenants:
            sums = fair.setdefault(t.name, {"virtual_tokens": 0.0, "waiting": 0, "running": 0, "fair_preemptions": 0})
            for attr in sums:
                sums[attr] += getattr(t, attr)
    for name, doc, attr in (("inferd_tenant_requests", "Requests admitted, per tenant.", "requests"),
                            ("inferd_tenant_prompt_tokens", "Prompt tokens of its finished requests.", "prompt_tokens"),
                            ("inferd_tenant_completion_tokens", "Tokens generated for it.", "completion_tokens")):
        family = CounterMetricFamily(name, doc, labels=["tenant"])
        for tenant in names:
            family.add_metric([tenant], getattr(accounts[tenant], attr))
        yield family
    rejections = CounterMetricFamily("inferd_tenant_rejections", "Its requests refused, by why.",
                                     labels=["tenant", "reason"])
    for tenant in names:
        for reason in (*GATEWAY_REASONS, *REASONS):
            rejections.add_metric([tenant, reason], accounts[tenant].rejections.get(reason, 0))
    yield rejections
    for name, doc, attr in (("inferd_tenant_ttft_seconds", "Time to first token, per tenant.", "ttft"),
                            ("inferd_tenant_tpot_seconds", "Time per output token, per tenant.", "tpot")):
        family = HistogramMetricFamily(name, doc, labels=["tenant"])
        for tenant in names:
            h = getattr(accounts[tenant], attr).histogram
            family.add_metric([tenant], buckets(h), h.total)
        yield family
    for name, doc, attr in (
            ("inferd_tenant_virtual_tokens", "Tokens served / weight (fair share: the least goes first).",
             "virtual_tokens"),
            ("inferd_tenant_requests_waiting", "Its requests (choices) waiting.", "waiting"),
            ("inferd_tenant_requests_running", "Its requests (choices) running.", "running")):
        family = GaugeMetricFamily(name, doc, labels=["tenant"])
        for tenant in names:
            family.add_metric([tenant], fair[tenant][attr] if tenant in fair else 0)
        yield family
    taken = CounterMetricFamily("inferd_tenant_fair_preemptions", "Its requests preempted to give a seat or KV "
                                "blocks to a tenant below its fair share.", labels=["tenant"])
    for tenant in names:
        taken.add_metric([tenant], fair[tenant]["fair_preemptions"] if tenant in fair else 0)
    yield taken


def drift_metrics(drift: DriftMonitor) -> Iterator[Metric]:
    """The window against the baseline (api/telemetry/drift.py; with [request_log] on). NOTE: PSI only per
    feature with requests on both sides."""
    report = drift.report()
    psi = GaugeMetricFamily("inferd_drift_psi", "Population stability index of a feature: the last "
                            "request_log.drift_window_seconds against the baseline (> 0.2: shifted).",
                            labels=["feature"])
    for feature, value in report.psi.items():
        psi.add_metric([feature], value)
    yield psi
    languages = GaugeMetricFamily("inferd_drift_language_ratio", "The window's prompt letters, share per script.",
                                  labels=["script"])
    for script in SCRIPTS:
        languages.add_metric([script], report.languages.get(script, 0.0))
    yield languages
    for name, doc, value in (
            ("inferd_drift_baseline_requests", "Requests in the drift baseline so far.", report.baseline_requests),
            ("inferd_drift_window_requests", "Requests in the drift window.", report.window_requests),
            ("inferd_drift_mean_prompt_tokens", "Mean prompt tokens in the window.", report.mean_prompt_tokens),
            ("inferd_drift_mean_completion_tokens", "Mean tokens per choice in the window.",
             report.mean_completion_tokens),
            ("inferd_drift_refusal_ratio", "Choices with a refusal phrase / choices, in the window.",
             report.refusal_rate)):
        if value is not None:
            yield GaugeMetricFamily(name, doc, value=value)


def model_metrics(registry: ModelRegistry) -> Iterator[Metric]:
    """Per model (labels: configured names and revisions only), and the routes' shares."""
    labels = ["model", "revision"]
    families = {
        "requests": CounterMetricFamily("inferd_model_requests", "Requests sent to a model (by name, alias, "
                                        "route or as a fallback).", labels=labels),
        "fallbacks": CounterMetricFamily("inferd_model_fallbacks", "Requests for a model sent to its fallback "
                                         "while it was degraded.", labels=labels),
        "reloads": CounterMetricFamily("inferd_model_reloads", "Revisions that took over.", labels=labels),
        "reloads_refused": CounterMetricFamily("inferd_model_reloads_refused", "Revisions discarded (load, "
                                               "probe or evaluation set failed).", labels=labels),
        "escalations": CounterMetricFamily("inferd_cascade_escalations", "Cascade: this (small) model's "
                                           "answers found unsure and asked of the large one.", labels=labels),
        "tokens_saved": CounterMetricFamily("inferd_cascade_tokens_saved", "Cascade: tokens the large model "
                                            "did not compute, as this model's answer sufficed.", labels=labels),
    }
    gauges = {
        "healthy": GaugeMetricFamily("inferd_model_healthy", "1: probe passes and engine runs.", labels=labels),
        "degraded": GaugeMetricFamily("inferd_model_degraded", "1: new requests go to the fallback.", labels=labels),
        "level": GaugeMetricFamily("inferd_model_degradation_level", "Functional degradation level (0 normal, "
                                   "1 streams whole, 2 max_tokens capped, 3 lowest class refused).", labels=labels),
        "running": GaugeMetricFamily("inferd_model_requests_running", "Requests running.", labels=labels),
        "waiting": GaugeMetricFamily("inferd_model_requests_waiting", "Requests waiting.", labels=labels),
        "kv": GaugeMetricFamily("inferd_model_kv_usage_ratio", "KV blocks in use / total.", labels=labels),
    }
    switches = CounterMetricFamily("inferd_model_degradation_switches", "Times a model's new requests started or "
                                   "stopped going to its fallback.", labels=labels)
    steps = CounterMetricFamily("inferd_model_degradation_steps", "Functional degradation level changes.",
                                labels=labels)
    for slot in registry.slots.values():
        counts, key = slot.counts, [slot.name, slot.latest_spec.revision]
        stats = slot.engine_snapshot  # (None: not loaded, or asleep)
        for name, family in families.items():
            family.add_metric(key, getattr(counts, name))
        switches.add_metric(key, slot.degradation.switches)
        steps.add_metric(key, slot.ladder.changes)
        for name, value in (("healthy", slot.healthy), ("degraded", slot.degradation.use_fallback),
                            ("level", slot.ladder.level), ("running", stats.running if stats else 0),
                            ("waiting", stats.waiting if stats else 0), ("kv", stats.kv_usage_ratio if stats else 0)):
            gauges[name].add_metric(key, float(value))
    yield from (*families.values(), switches, steps, *gauges.values())
    yield from lifecycle_metrics(registry)
    yield from door_metrics(registry)
    share = GaugeMetricFamily("inferd_route_share", "A route's configured share per target.", labels=["route", "model"])
    for name, route in registry.routes.items():
        for model, value in route.shares().items():
            share.add_metric([name, model], value)
    yield share


def door_metrics(registry: ModelRegistry) -> Iterator[Metric]:
    """Each model's refusals at its door and its structured outputs (its slot's: they outlive
    its revisions)."""
    labels = ["model", "revision"]
    rejections = CounterMetricFamily("inferd_model_rejections", "Requests refused at a model's door, by why.",
                                     labels=[*labels, "reason"])
    grammars = CounterMetricFamily("inferd_model_structured_requests", "A model's requests held to a grammar, "
                                   "by where it came from.", labels=[*labels, "kind"])
    for slot in registry.slots.values():
        key, counts = [slot.name, slot.latest_spec.revision], slot.counts.door
        by_reason = counts.rejections_by_reason()
        for reason in REASONS:
            rejections.add_metric([*key, reason], by_reason.get(reason, 0))
        for kind in GRAMMAR_KINDS:
            grammars.add_metric([*key, kind], counts.grammars.get(kind, 0))
    yield rejections
    yield grammars
    yield from pooling_metrics(registry)


def pooling_metrics(registry: ModelRegistry) -> Iterator[Metric]:
    """Each model's pooling requests (embeddings, rerank and score), apart from its generations."""
    labels = ["model", "revision", "task"]
    families = {attr: CounterMetricFamily(f"inferd_model_pooling_{attr}", doc, labels=labels) for attr, doc in (
        ("requests", "Pooling requests answered (/v1/embeddings: embed; /v1/rerank, /v1/score: score)."),
        ("inputs", "Their inputs: texts embedded, documents or pairs scored."),
        ("prompt_tokens", "Their inputs' tokens."))}
    for slot in registry.slots.values():
        for task, counts in slot.counts.pooling.items():
            for attr, family in families.items():
                family.add_metric([slot.name, slot.latest_spec.revision, task], getattr(counts, attr))
    yield from families.values()


def summed(registry: ModelRegistry, counts: Callable[[ModelSlot], Mapping[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for slot in registry.slots.values():
        total.update(counts(slot))
    return dict(total)


def expert_metrics(routed: tuple[tuple[int, ...], ...]) -> Iterator[Metric]:
    """A mixture-of-experts model's routing (EngineSnapshot.experts_routed): tokens per expert,
    summed over its layers, and each layer's imbalance (its busiest expert's tokens over the mean;
    1 is even). Labels: expert and layer numbers, bounded by the model."""
    if not routed:
        return
    tokens = CounterMetricFamily("inferd_moe_expert_tokens", "Tokens routed to an expert, summed over the layers.",
                                 labels=["expert"])
    for expert, count in enumerate(map(sum, zip(*routed))):
        tokens.add_metric([str(expert)], count)
    yield tokens
    imbalance = GaugeMetricFamily("inferd_moe_layer_imbalance", "Tokens routed to a layer's busiest expert over "
                                  "the mean of its experts (1: even).", labels=["layer"])
    for layer, counts in enumerate(routed):
        mean = sum(counts) / len(counts)
        imbalance.add_metric([str(layer)], max(counts) / mean if mean else 1.0)
    yield imbalance
