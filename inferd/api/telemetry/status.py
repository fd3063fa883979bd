"""GET /v1/status: the server, its models, classes, tenants and requests now, as one JSON page
(`inferd status` draws it); and the tenants' rows that /admin/tenants shows too.

A tenant's key sees its own row and its own requests only; an admin key (or any caller of a
server with no keys) sees them all. The top level and `classes` describe the first model (the
one of a single-model server); `models` has every model, `tenants` sums every engine's share.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

from aiohttp import web

from inferd import __version__
from inferd.api.gateway.gate import GATEWAY, Gateway
from inferd.api.gateway.keys import principal_of
from inferd.api.gateway.tenants import Principal
from inferd.api.routing.registry import REGISTRY, ModelRegistry, ModelSlot
from inferd.api.state import STATE
from inferd.api.streaming.resume import RESUMABLE
from inferd.api.telemetry import status_wire as s
from inferd.api.telemetry.loop_lag import LOOP_LAG
from inferd.api.telemetry.model_life import NOT_LOADED, model_life
from inferd.api.telemetry.request_file import REQUEST_JOURNAL
from inferd.api.wire import dump
from inferd.engine.protocol import EngineSnapshot
from inferd.settings.policy import PriorityClass


def visible_tenant(principal: Principal) -> str | None:
    """The one tenant a caller may see (its own); None: it may see every tenant."""
    return None if principal.admin or principal.tenant is None else principal.tenant.name


def tenant_statuses(gateway: Gateway, snapshots: Iterable[EngineSnapshot], only: str | None) -> list[s.TenantStatus]:
    """Each tenant's row: the gateway's accounts, and its fair share summed over every engine."""
    waiting: dict[str | None, int] = {}
    running: dict[str | None, int] = {}
    virtual: dict[str | None, float] = {}
    taken: dict[str | None, int] = {}
    for snapshot in snapshots:
        for t in snapshot.tenants:
            waiting[t.name] = waiting.get(t.name, 0) + t.waiting
            running[t.name] = running.get(t.name, 0) + t.running
            virtual[t.name] = virtual.get(t.name, 0.0) + t.virtual_tokens
            taken[t.name] = taken.get(t.name, 0) + t.fair_preemptions
    rows = []
    for name, tenant in gateway.keyring.tenants.items():
        if only is not None and name != only:
            continue
        account, limiter = gateway.accounts[name], gateway.limiters[name]
        rows.append(s.TenantStatus(
            name=name, tier=tenant.tier, weight=tenant.weight, requests=account.requests,
            prompt_tokens=account.prompt_tokens, completion_tokens=account.completion_tokens,
            rejections=dict(account.rejections), waiting=waiting.get(name, 0), running=running.get(name, 0),
            virtual_tokens=virtual.get(name, 0.0), fair_preemptions=taken.get(name, 0), ttft_p50_seconds=account.ttft.percentile(50),
            ttft_p95_seconds=account.ttft.percentile(95), tpot_p50_seconds=account.tpot.percentile(50),
            remaining_requests=limiter.remaining_requests, remaining_tokens=limiter.remaining_tokens,
        ))
    return rows


def engine_snapshots(registry: ModelRegistry) -> list[EngineSnapshot]:
    """Every loaded revision's snapshot (retiring ones too: their requests still run)."""
    return [served.engine.snapshot for served in registry.served()]


def _limits(cls: PriorityClass) -> s.ClassLimits:
    t = cls.timeouts
    return s.ClassLimits(
        max_waiting=cls.max_waiting, max_queued_tokens=cls.max_queued_tokens, ttft_target=cls.ttft_target,
        tpot_target=cls.tpot_target, queue_timeout=t.queue, ttft_timeout=t.ttft, token_timeout=t.token,
        total_timeout=t.total, max_tokens=cls.max_tokens, kv_reserve=cls.kv_reserve, sheddable=cls.sheddable,
    )


def _classes(slot: ModelSlot) -> list[s.ClassStatus]:
    assert slot.current is not None
    engine = slot.current.engine
    rejections: dict[str, dict[str, int]] = {}
    for (name, reason), count in slot.counts.door.rejections.items():
        rejections.setdefault(name, {})[reason] = count
    return [
        s.ClassStatus(
            name=c.name, priority=c.priority, waiting=c.waiting, queued_tokens=c.queued_tokens,
            oldest_wait_seconds=c.oldest_wait, running=c.running, kv_blocks_used=c.kv_blocks_used,
            queued_token_seconds=c.queued_token_seconds, prompt_tokens=c.prompt_tokens,
            cached_prompt_tokens=c.cached_prompt_tokens, generation_tokens=c.generation_tokens,
            ttft_p50_seconds=c.ttft_p50, ttft_p95_seconds=c.ttft_p95, tpot_p50_seconds=c.tpot_p50,
            queue_time_p95_seconds=c.queue_time_p95, finished=c.finished, preemptions=c.preemptions,
            timeouts=c.timeouts, rejections=rejections.get(c.name, {}), deadline_misses=c.deadline_misses,
            limits=_limits(engine.limits.priority_class(c.name)),
        )
        for c in engine.snapshot.classes
    ]


def _experts(experts: tuple[int, int] | None) -> str | None:
    return None if experts is None else f"{experts[1]} of {experts[0]} experts"


def model_statuses(registry: ModelRegistry) -> list[s.ModelStatus]:
    out = []
    for slot in registry.slots.values():
        served, counts, spec, limits = slot.current, slot.counts, slot.latest_spec, slot.limits
        stats = slot.engine_snapshot or NOT_LOADED
        out.append(s.ModelStatus(
            name=slot.name, state=slot.life.state, life=model_life(slot), revision=spec.revision,
            aliases=list(spec.aliases), path=limits.model_path if limits else spec.path or "(the embedded model)",
            experts=_experts(limits.experts) if limits else None, healthy=slot.healthy,
            probe_error=served.health.probe_error if served else None,
            fallback=spec.fallback, degraded=slot.degradation.use_fallback,
            degraded_reason=slot.degradation.reason, functional_level=slot.ladder.name,
            previous_revision=None if slot.previous is None else slot.previous.revision,
            retiring_revisions=[r.spec.revision for r in slot.retiring], running=stats.running, waiting=stats.waiting,
            kv_blocks_used=stats.kv_blocks_used, kv_blocks_total=stats.kv_blocks_total, requests=counts.requests,
            fallbacks=counts.fallbacks, reloads=counts.reloads, reloads_refused=counts.reloads_refused,
            escalations=counts.escalations, tokens_saved=counts.tokens_saved,
            task=limits.task if limits else str(spec.pooling.get("task", "generate")),
            pooling={task: s.PoolingStatus(requests=c.requests, inputs=c.inputs, prompt_tokens=c.prompt_tokens)
                     for task, c in counts.pooling.items()},
        ))
    return out


def _requests(snapshot: EngineSnapshot, only: str | None) -> list[s.RequestEntry]:
    return [s.RequestEntry(id=r.group_id, index=r.index, class_=r.class_name, state=r.state, age_seconds=r.age,
                           prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens, ttft_seconds=r.ttft,
                           tenant=r.tenant)
            for r in snapshot.requests if only is None or r.tenant == only]


async def status(request: web.Request) -> web.Response:
    registry, state = request.app[REGISTRY], request.app[STATE]
    slot = registry.lead
    if slot is None or slot.current is None:  # (every model on demand, none loaded now)
        return web.json_response(dump(_nothing_loaded(request, registry)))
    engine = slot.current.engine
    stats, limits = engine.snapshot, engine.limits
    now = time.monotonic()
    generation_rate, prompt_rate = engine.throughput.rates(now)
    only = visible_tenant(principal_of(request))  # a tenant sees its own requests and row only
    memory = stats.device_memory
    journal = request.app.get(REQUEST_JOURNAL)
    body = s.StatusResponse(
        model=state.model_name, dtype=limits.dtype, device=limits.device, version=__version__,
        uptime_seconds=now - state.started, state=registry.readiness()[0], max_model_len=limits.max_model_len,
        kv_blocks_total=stats.kv_blocks_total, kv_blocks_used=stats.kv_blocks_used,
        kv_blocks_cached=stats.kv_blocks_cached, running=stats.running, waiting=stats.waiting, steps=stats.steps,
        preemptions=stats.preemptions, timeouts=stats.timeouts, rejections=slot.counts.door.rejections_by_reason(),
        prefix_cache_queries=stats.prefix_queries, prefix_cache_hits=stats.prefix_hits,
        shed_level=stats.shed_level, shed_actions=stats.shed_actions, kv_usage_ratio=stats.kv_usage_ratio,
        throughput=s.Throughput(generation_tokens_per_second=generation_rate, prompt_tokens_per_second=prompt_rate,
                                history=engine.throughput.history(now)),
        device_memory=None if memory is None else s.DeviceMemory(used_bytes=memory.used_bytes,
                                                                  total_bytes=memory.total_bytes),
        state_slots=None if (state := stats.state_slots) is None else s.StateSlotsStatus(
            total=state.total, working=state.working, checkpoints=state.checkpoints,
            checkpoint_bytes=state.checkpoint_bytes, checkpoint_hits=state.checkpoint_hits,
            checkpoint_hit_tokens=state.checkpoint_hit_tokens, checkpoint_evictions=state.checkpoint_evictions),
        speculation=None if (spec := stats.speculation) is None else s.SpeculationStatus(
            method=spec.method, drafted_tokens=spec.drafted_tokens, accepted_tokens=spec.accepted_tokens,
            verifications=spec.verifications, steps_off=spec.steps_off, off_reason=spec.off_reason),
        cache_tiers=None if stats.cache_tiers is None else s.CacheTiersStatus(**dataclasses.asdict(stats.cache_tiers)),
        engine_healthy=stats.healthy, step_failures=stats.step_failures,
        oom_events_last_minute=stats.oom_events_last_minute, token_budget=stats.token_budget,
        resumable_streams_detached=request.app[RESUMABLE].detached,
        event_loop_lag_seconds=request.app[LOOP_LAG].worst_recent,
        classes=_classes(slot),
        requests=_requests(stats, only),
        tenants=tenant_statuses(request.app[GATEWAY], engine_snapshots(registry), only),
        drift=journal.drift.report() if journal is not None and only is None else None,
        models=model_statuses(registry),
        routes=[s.RouteStatus(name=name, kind="cascade" if r.cascade else "split", shares=r.shares())
                for name, r in registry.routes.items()],
    )
    return web.json_response(dump(body))


def _nothing_loaded(request: web.Request, registry: ModelRegistry) -> s.StatusResponse:
    """The top level while no model is loaded (every model on demand): the server's own figures,
    zeros for an engine's; `models` has each model's state."""
    state, now = request.app[STATE], time.monotonic()
    only = visible_tenant(principal_of(request))
    return s.StatusResponse(
        model=state.model_name, dtype="", device="", version=__version__, uptime_seconds=now - state.started,
        state=registry.readiness()[0], max_model_len=0, kv_blocks_total=0, kv_blocks_used=0, kv_blocks_cached=0,
        running=0, waiting=0, steps=0, preemptions={}, timeouts={}, rejections={}, prefix_cache_queries=0,
        prefix_cache_hits=0, shed_level=0, shed_actions={}, kv_usage_ratio=0.0,
        throughput=s.Throughput(generation_tokens_per_second=0.0, prompt_tokens_per_second=0.0, history=[]),
        device_memory=None, resumable_streams_detached=request.app[RESUMABLE].detached,
        event_loop_lag_seconds=request.app[LOOP_LAG].worst_recent, classes=[], requests=[],
        tenants=tenant_statuses(request.app[GATEWAY], [], only), models=model_statuses(registry),
        routes=[s.RouteStatus(name=name, kind="cascade" if r.cascade else "split", shares=r.shares())
                for name, r in registry.routes.items()],
    )
