"""inferd's own replies, beside the OpenAI protocol (api/openai/wire.py): liveness, readiness,
and the engine's status. They document the API (GET /openapi.json) and build the replies of
endpoints.py and status.py."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from inferd.api.wire import ResponseModel


class HealthResponse(ResponseModel):
    status: Literal["ok", "unavailable"]


class ReadyResponse(ResponseModel):
    status: Literal["loading", "ready", "draining", "not_ready"]
    reason: str | None = None  # why the inference probe failed


class ClassLimits(ResponseModel):
    max_waiting: int
    max_queued_tokens: int
    ttft_target: float
    tpot_target: float
    queue_timeout: float | None
    ttft_timeout: float | None
    token_timeout: float | None
    total_timeout: float | None
    max_tokens: int
    kv_reserve: float
    sheddable: bool


class ClassStatus(ResponseModel):
    name: str
    priority: int
    limits: ClassLimits
    waiting: int
    queued_tokens: int
    oldest_wait_seconds: float
    running: int
    kv_blocks_used: int
    queued_token_seconds: float
    prompt_tokens: int
    cached_prompt_tokens: int
    generation_tokens: int
    ttft_p50_seconds: float | None
    ttft_p95_seconds: float | None
    tpot_p50_seconds: float | None
    queue_time_p95_seconds: float | None
    finished: dict[str, int]
    preemptions: dict[str, int]
    timeouts: dict[str, int]
    rejections: dict[str, int]
    deadline_misses: dict[str, int]


class RequestEntry(ResponseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    id: int
    index: int  # the choice, for n > 1
    class_: str = Field(alias="class")
    state: Literal["running", "waiting", "swapped"]
    age_seconds: float
    prompt_tokens: int
    output_tokens: int
    ttft_seconds: float | None
    tenant: str | None = None


class TenantStatus(ResponseModel):
    """One tenant: its use since start, its place in the fair share, what its buckets hold."""

    name: str
    tier: str
    weight: float
    requests: int  # admitted
    prompt_tokens: int
    completion_tokens: int
    rejections: dict[str, int]  # by reason
    waiting: int
    running: int
    virtual_tokens: float  # tokens served / weight (with the lift on return from idle): least goes first
    fair_preemptions: int = 0  # its requests preempted to give seats or blocks to a tenant below its share
    ttft_p50_seconds: float | None
    ttft_p95_seconds: float | None
    tpot_p50_seconds: float | None
    remaining_requests: int | None  # None: no such limit
    remaining_tokens: int | None


class Throughput(ResponseModel):
    generation_tokens_per_second: float  # over the last 10 s
    prompt_tokens_per_second: float
    history: list[float]  # generation tokens in each of the last 60 s, oldest first


class DeviceMemory(ResponseModel):
    used_bytes: int
    total_bytes: int


class StateSlotsStatus(ResponseModel):
    """A hybrid model's recurrent-state slots (its linear-attention layers' cache)."""

    total: int
    working: int  # held by running requests
    checkpoints: int  # prefix-cache checkpoints (evictable)
    checkpoint_bytes: int
    checkpoint_hits: int  # prompts that resumed from one
    checkpoint_hit_tokens: int
    checkpoint_evictions: int


class CacheTiersStatus(ResponseModel):
    """The prefix cache's host tier and sessions (kv_host_cache_memory, session retention)."""

    host_blocks_total: int  # 0: no host tier
    host_blocks_used: int
    host_hit_tokens: int  # prompt tokens it served, since start
    offloaded_blocks: int
    onloaded_blocks: int
    dropped_blocks: int
    sessions: int  # holding a prefix now
    session_blocks: int
    session_released_blocks: int


class SpeculationStatus(ResponseModel):
    """Speculative decoding since start ([speculative])."""

    method: str  # auto, suffix, ngram or off
    drafted_tokens: int  # verified
    accepted_tokens: int  # of which accepted
    verifications: int  # decodes that verified drafts
    steps_off: int  # steps "auto" ran without drafts: too many requests decoding
    off_reason: str | None = None  # why this model cannot speculate


class DriftStatus(ResponseModel):
    """Traffic now against the baseline (the first requests): [request_log], api/telemetry/drift.py."""

    baseline_requests: int  # in the baseline so far
    baseline_complete: bool  # it has request_log.baseline_requests; the window fills only then
    window_seconds: float
    window_requests: int  # finished in the window
    psi: dict[str, float]  # per feature: population stability index, window against baseline
    mean_prompt_tokens: float | None  # in the window
    mean_completion_tokens: float | None  # per choice
    refusal_rate: float | None  # choices with a refusal phrase / choices
    languages: dict[str, float]  # the window's prompts' letters, share per script
    finish_reasons: dict[str, float]  # share per reason


class PoolingStatus(ResponseModel):
    requests: int
    inputs: int  # texts embedded, documents or pairs scored
    prompt_tokens: int


class ModelLife(ResponseModel):
    """When a model is loaded and kept, and what its lifecycle did (routing/lifecycle.py)."""

    load: str = "start"  # start, on_demand
    pinned: bool = False
    sleep_level: int | None = None  # asleep: 1 (KV cache freed) or 2 (weights freed too)
    idle_unload_seconds: float | None = None
    idle_seconds: float = 0.0  # since it last served a request (or loaded)
    holders: int = 0  # requests holding it now
    loads: int = 0
    load_failures: int = 0
    load_error: str | None = None  # why its last load failed
    load_seconds: float = 0.0  # its last load's (or wake's)
    unloads: int = 0
    switches: int = 0  # its loads that unloaded another model to make room
    sleeps: int = 0
    wakes: int = 0
    load_waits: int = 0  # requests that waited for it to load, wake or find room
    load_wait_timeouts: int = 0  # of which got 503 after [server] model_load_wait_seconds


class ModelStatus(ResponseModel):
    name: str
    state: str = "serving"  # serving, loading, unloading, asleep, waking, unloaded, failed
    life: ModelLife = ModelLife()
    revision: str
    aliases: list[str]
    path: str
    experts: str | None = None  # a mixture-of-experts model: "top-k of E experts"
    healthy: bool
    probe_error: str | None = None
    fallback: str | None = None
    degraded: bool  # its new requests go to its fallback
    degraded_reason: str | None = None
    functional_level: str  # normal, whole, capped, refuse_lowest
    previous_revision: str | None = None  # what a rollback returns to
    retiring_revisions: list[str] = []  # old revisions still draining
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    requests: int
    fallbacks: int
    reloads: int
    reloads_refused: int
    escalations: int
    tokens_saved: int
    task: str = "generate"  # what it serves: generate, embed or score
    pooling: dict[str, PoolingStatus] = {}  # its pooling requests by task (embed, score), apart from generations



class RouteStatus(ResponseModel):
    name: str
    kind: str  # split or cascade
    shares: dict[str, float]


class StatusResponse(ResponseModel):
    model: str
    dtype: str
    device: str
    version: str
    uptime_seconds: float
    state: Literal["loading", "ready", "draining", "not_ready"]
    max_model_len: int
    kv_blocks_total: int
    kv_blocks_used: int  # held by requests
    kv_blocks_cached: int  # prefix-cache blocks no request holds (evictable)
    running: int
    waiting: int
    steps: int
    preemptions: dict[str, int]  # by mode
    timeouts: dict[str, int]  # by kind
    rejections: dict[str, int]  # by reason
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    shed_level: int
    shed_actions: dict[str, int]  # load shedder transitions: "escalate", "recover", "level:N"
    kv_usage_ratio: float
    throughput: Throughput
    device_memory: DeviceMemory | None  # CUDA only
    state_slots: StateSlotsStatus | None = None  # a hybrid model's (linear-attention layers)
    speculation: SpeculationStatus | None = None
    cache_tiers: CacheTiersStatus | None = None
    engine_healthy: bool = True  # false after failed steps in a row, until it recovers
    step_failures: dict[str, int] = {}  # by kind: forward, request, oom
    oom_events_last_minute: int = 0
    token_budget: int = 0  # tokens per step now (halved after an out-of-memory step)
    resumable_streams_detached: int = 0  # resumable streams whose client left, within their grace
    event_loop_lag_seconds: float = 0.0  # the worst lateness of the loop's timer in the last ~10 s
    classes: list[ClassStatus]
    requests: list[RequestEntry]  # running first, at most 100; a tenant sees only its own
    tenants: list[TenantStatus] = []  # a tenant sees only itself
    models: list[ModelStatus] = []  # every served model (the top level describes the first)
    routes: list[RouteStatus] = []
    drift: DriftStatus | None = None  # with [request_log] on; not shown to a tenant
