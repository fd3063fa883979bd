"""The typed seam between the API and the engine: what goes in, what comes out, what is published.

    front door (event loop)                      engine thread
    -----------------------                      -------------
    EngineRequest  ──AsyncEngine.submit──>       LLMEngine.add_request
    group_id       ──AsyncEngine.abort───>       LLMEngine.abort
    RequestStream  <──StepOutputs (per step)──   LLMEngine.step: EngineOutput per choice,
                                                 the groups first scheduled, the prefill timing
    EngineSnapshot <──published every ~50 ms──   counters, queues, histograms, device memory
    EngineLimits       fixed at start-up: what the door validates against

A *group* is what a client sees as one request (one prompt with its n choices); a *seq* is one
choice. Everything here is plain data: no torch, no asyncio, no aiohttp.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from inferd.settings.policy import PriorityClass, SchedulingPolicy, Timeouts
from inferd.text.sampling_params import SamplingParams
from inferd.text.tokenizer import Tokenizer


# ------------------------------------------------------------------- the snapshot's parts

SAMPLE_WINDOW = 1024  # recent samples kept per series (for percentiles on the status page)


# histogram bucket upper bounds (the last bucket, +Inf, is implicit)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                   7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass
class Histogram:
    """Counts per bucket (Prometheus' model, kept here without it: the engine has no control
    plane imports). `counts[i]` counts values <= bounds[i] and > bounds[i - 1]; the last, the rest."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)


@dataclass
class Samples:
    """A latency series: a histogram since start, plus the most recent values."""

    histogram: Histogram = field(default_factory=Histogram)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))

    def add(self, value: float) -> None:
        self.histogram.observe(value)
        self.recent.append(value)

    def percentile(self, q: float) -> float | None:
        """The q-th percentile (0..100) of the recent values; None when empty."""
        return percentile(self.recent, q) if self.recent else None


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q% of the values <= it (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class ClassSnapshot:
    """One class's state and counters at the end of a step, for other threads."""

    name: str
    priority: int
    waiting: int
    queued_tokens: int  # prompt tokens still to compute for the waiting requests
    oldest_wait: float  # seconds the longest-waiting request has waited (0 when none)
    running: int
    kv_blocks_used: int  # blocks in the running requests' tables (shared ones once per table)
    queued_token_seconds: float
    prompt_tokens: int
    cached_prompt_tokens: int
    generation_tokens: int
    ttft_p50: float | None
    ttft_p95: float | None
    tpot_p50: float | None
    queue_time_p95: float | None
    finished: dict[str, int]
    preemptions: dict[str, int]
    timeouts: dict[str, int]
    deadline_misses: dict[str, int]
    histograms: dict[str, Histogram]  # copies: ttft, itl, tpot, e2e, queue_time


@dataclass(frozen=True)
class RequestSnapshot:
    """One unfinished request (one choice of it) for the status page."""

    group_id: int  # the id the engine's caller knows; all choices of a request share it
    index: int  # the choice
    class_name: str
    state: str  # "running", "waiting" or "swapped"
    age: float  # seconds since it arrived
    prompt_tokens: int
    output_tokens: int
    ttft: float | None  # None until its first token
    tenant: str | None = None  # whose request it is (the API shows a tenant only its own)


@dataclass(frozen=True)
class TenantSnapshot:
    """One tenant's fair share (engine/sched/fairness.py) at the end of a step, for other threads."""

    name: str | None  # None: the requests that name no tenant, as one
    weight: float
    virtual_tokens: float  # its counter: tokens served / weight, lifted on return from idle
    served_tokens: int  # tokens computed for it (prompt and output; recomputation included)
    waiting: int
    running: int
    fair_preemptions: int = 0  # its requests preempted to give a seat or blocks to a tenant below its share


# ------------------------------------------------------------------------------ the seam


class ConstraintError(ValueError):
    """A request's own constraint cannot go on (a grammar met one of its limits, or refused a
    token): the client's fault, the same again if it is sent again; its request fails alone with
    "invalid_grammar", and the engine's health does not count it."""


class LogitsConstraint(Protocol):
    """A per-choice constraint on the next token (a grammar, a tool-call schema), called by the
    engine thread. `fill_mask` writes the tokens the choice may sample next into a bitmask
    (numpy int32 [ceil(V/32)], bit i of word i // 32 set = token i allowed), filled while the
    model runs; the sampler masks the rest, for greedy and sampled rows alike. `accept` advances
    it with the token sampled, and returns True when the choice ends with that token (finish
    reason "stop": a tool call repeated, engine/structured/repeats.py). Raising from either fails that choice alone (a ConstraintError: as
    the client's fault). `fork` gives an independent copy (made before any token) for each
    further choice of an n > 1 group. A preemption keeps the
    sampled tokens, so it keeps the state too. inferd/engine/structured/grammar.py has the grammar one."""

    def fill_mask(self, mask: Any) -> None: ...

    def accept(self, token_id: int) -> bool | None: ...

    def fork(self) -> LogitsConstraint: ...


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """A prefill-only request: nothing is sampled. Task "embed": its prompt's final hidden states
    pooled by the model's pooler (inferd.model.pooling: last, mean or cls; dense layers; normalized)
    into `EngineOutput.pooled`. Task "score": its last position's logits read as one number,
    logit[yes] - logit[no] (`score_tokens`), into `EngineOutput.score` (Qwen3-Reranker)."""

    task: str = "embed"  # "embed" or "score"
    score_tokens: tuple[int, int] | None = None  # ("score") the (no, yes) token ids


@dataclass(frozen=True, slots=True)
class PoolerInfo:
    """What a model's pooler makes (EngineLimits.pooler): the door and the API check against it."""

    method: str  # "last", "mean" or "cls"
    normalize: bool
    dimensions: int  # the length of a pooled vector (after any dense layers)
    matryoshka: bool  # its vectors may be truncated to a prefix (`dimensions` in a request)
    max_prompt_tokens: int  # the longest input: the context, or one step's tokens (bidirectional)


@dataclass(frozen=True, slots=True)
class Session:
    """A conversation whose newest prefix the KV cache keeps ahead of anonymous blocks for a while
    (engine/kv/retention.py): named by the client (prompt_cache_key, x-session-id, Anthropic's
    cache_control), scoped to its tenant at the door."""

    key: str  # unique per tenant: the door prefixes the tenant's name
    ttl: float  # seconds its prefix is kept after its last request ends
    priority: int = 0  # higher: evicted later among sessions (the request's class's rank)


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One prompt with its n choices, checked by the door against `EngineLimits`: the engine
    asserts what it relies on and does not check again."""

    group_id: int  # unique while it runs (AsyncEngine.new_group_id)
    prompt_ids: list[int]
    params: SamplingParams
    priority_class: str  # a class name of the engine's policy, resolved at the door
    n: int = 1
    timeouts: Timeouts = Timeouts()  # the request's own; the class's are tightened by them
    arrival_time: float | None = None  # on the engine's clock (time.monotonic); None: now
    tenant: str | None = None  # who pays for it: accounting, and fair sharing inside its class
    tenant_weight: float = 1.0  # the tenant's share against the others' (fair sharing, > 0)
    # the prefix cache's namespace: cached blocks are shared only between requests with the same
    # salt (the door gives each tenant its own); b"": the shared one
    cache_salt: bytes = b""
    constraint: LogitsConstraint | None = None  # the slot for per-request logits constraints
    segment: str = "token"  # how text is released: per token, in whole "sentence"s or "line"s
    pooling: PoolingParams | None = None  # a prefill-only request (n = 1, params unused but its limits)
    # speculation may draft from its tenant's recent outputs (its tenant opted in; never another's)
    draft_history: bool = False
    session: Session | None = None  # keep its prefix cached between turns (the tool pause)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, best first


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """How a finished choice went, in seconds from its arrival (None: it never got there)."""

    priority_class: str
    prompt_tokens: int
    cached_tokens: int  # of which the prefix cache supplied
    output_tokens: int
    queue_time: float | None
    ttft: float | None
    e2e: float
    preemptions: int
    drafted_tokens: int = 0  # speculation: draft tokens verified
    accepted_tokens: int = 0  # of which accepted (handed out without a step of their own)
    host_cached_tokens: int = 0  # of cached_tokens, how many came back from the host tier
    # why the prefix cache supplied less than the prompt's cacheable part (kv/misses.py's words:
    # "evicted", "diverged at token N", "another tenant's namespace", "volatile block", "cold"); None: a full hit
    cache_miss: str | None = None


FAILURE_KINDS = ("forward", "request", "oom")  # EngineSnapshot.step_failures' keys (engine/health.py)

# finish_reason "error": what failed, and whether the same request may succeed if sent again
ERROR_CODES = {
    "internal_error": False,  # its own processing raised (detokenizer, stops, a hook)
    "invalid_grammar": False,  # its grammar could not go on (ConstraintError): a client fault
    "engine_error": True,  # the forward of its step failed; the engine goes on
    "out_of_memory": True,  # its chunk did not fit in memory even alone
}


@dataclass(slots=True)
class EngineOutput:
    """What one step produced for one choice of one group."""

    group_id: int
    new_token_ids: list[int]
    text: str  # new text (stop strings, held-back partial characters and text hooks hold back excluded)
    index: int = 0  # which of the group's n choices
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "content_filter", "abort", "timeout" or "error"
    stop_reason: str | int | None = None  # the stop string or token id that matched; the
    # timeout's kind ("queue", "ttft", "token", "total") with "timeout"; a message with "abort"
    # and "error"
    logprobs: list[TokenLogprob] | None = None
    # (prompt_logprobs) with a choice's first output: every prompt token's after the first
    prompt_logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics | None = None  # with the finished output
    error: str | None = None  # with "error", which: ERROR_CODES
    pooled: list[float] | None = None  # (a pooling request's finished output, task "embed") its vector
    score: float | None = None  # (task "score") logit[yes] - logit[no] at its last position

    def extend(self, later: EngineOutput) -> None:
        """Take in a later output of the same choice and step (speculation hands out several
        tokens a step): its tokens, text and logprobs after these, and how it ended."""
        self.new_token_ids += later.new_token_ids
        self.text += later.text
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finished, self.finish_reason, self.stop_reason = later.finished, later.finish_reason, later.stop_reason
        self.metrics, self.error = later.metrics, later.error


@dataclass(slots=True)
class StepOutputs:
    """Everything one engine step tells the event loop, delivered in one callback."""

    outputs: list[EngineOutput] = field(default_factory=list)
    started: list[int] = field(default_factory=list)  # groups first scheduled (they left the queue)
    prefill_tokens: int = 0  # prompt tokens this step computed ...
    step_seconds: float = 0.0  # ... in a step that took this long (the door predicts TTFT from it)
    kv_events: Sequence[Any] = ()  # ([kv_events] on) the prefix cache's events (engine/kv/events.py)


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Fixed facts of a running engine: what the door validates requests against."""

    max_model_len: int  # prompt + output tokens never exceed it
    vocab_size: int
    max_num_seqs: int  # the most choices one group may have
    block_size: int
    num_kv_blocks: int
    class_kv_tokens: dict[str, int]  # the KV tokens each class may hold (its reserve excluded)
    policy: SchedulingPolicy
    architecture: str
    num_layers: int
    dtype: str  # "bfloat16", ...
    device: str  # "cpu", "cuda:0"
    model_path: str  # the GGUF file or Hugging Face folder it serves
    output_filter: bool = False  # a blocklist filters the text (so logprobs' token strings would not be)
    experts: tuple[int, int] | None = None  # a mixture-of-experts model: (experts, active per token)
    task: str = "generate"  # what it serves: "generate", "embed" or "score" ([model] task)
    pooler: PoolerInfo | None = None  # what /v1/embeddings gets from it; None: it answers none

    def priority_class(self, name: str) -> PriorityClass:
        return self.policy.lookup(name)


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class SpeculationSnapshot:
    """Speculative decoding's counters since start (engine/spec/)."""

    method: str  # "auto", "suffix", "ngram" or "off"
    drafted_tokens: int  # draft tokens verified
    accepted_tokens: int  # of which accepted
    verifications: int  # decodes that verified drafts
    steps_drafted: int  # steps in which some request verified drafts
    steps_off: int  # steps "auto" ran without drafts: more requests decoding than its max_batch
    off_reason: str | None = None  # why the model cannot speculate (None: it can)


@dataclass(frozen=True, slots=True)
class CacheTiersSnapshot:
    """The prefix cache's host tier and sessions (engine/kv/cache_tiers.py), counters since start."""

    host_blocks_total: int  # the host tier's size (0: none)
    host_blocks_used: int
    host_hit_tokens: int  # prompt tokens it supplied
    offloaded_blocks: int  # copied to it on eviction
    onloaded_blocks: int  # copied back on a hit
    dropped_blocks: int  # evicted with no room in it
    sessions: int  # sessions holding a prefix now
    session_blocks: int  # cache keys they hold now
    session_released_blocks: int  # let go by a newer state or a tenant's bound


@dataclass(frozen=True, slots=True)
class StateSlotsSnapshot:
    """A hybrid model's state slots (engine/kv/state_slots.py)."""

    total: int
    working: int  # held by running sequences
    checkpoints: int  # prefix-cache checkpoints filed (evictable)
    bytes_per_slot: int
    checkpoint_hits: int  # prompts that resumed from a checkpoint, since start
    checkpoint_hit_tokens: int  # prompt tokens they resumed past
    checkpoints_filed: int
    checkpoint_evictions: int

    @property
    def checkpoint_bytes(self) -> int:
        return self.checkpoints * self.bytes_per_slot


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state as published after a step (read from any thread, never mutated)."""

    kv_blocks_total: int
    kv_blocks_used: int  # held by requests
    kv_blocks_cached: int  # prefix-cache blocks no request holds (evictable, so free in effect)
    running: int
    waiting: int
    steps: int
    preemptions: dict[str, int]  # by mode
    timeouts: dict[str, int]  # by kind
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of which found
    shed_level: int
    shed_actions: dict[str, int]  # load shedder transitions: "escalate", "recover", "level:N"
    last_step_seconds: float
    classes: tuple[ClassSnapshot, ...]  # most important first
    requests: tuple[RequestSnapshot, ...]  # running first, at most STATUS_REQUESTS
    step_seconds: Histogram  # (copies) the duration of each engine step
    batch_tokens: Histogram  # and the tokens it computed
    device_memory: DeviceMemory | None = None  # CUDA only
    healthy: bool = True  # not failing steps in a row (engine/health.py)
    consecutive_step_failures: int = 0
    step_failures: dict[str, int] = field(default_factory=dict)  # by kind: forward, request, oom
    oom_events_last_minute: int = 0
    token_budget: int = 0  # tokens per step now (lowered after an out-of-memory step)
    tenants: tuple[TenantSnapshot, ...] = ()  # fair sharing's counters (empty under fcfs)
    # a mixture-of-experts model: tokens routed to each expert since start, per sparse layer
    experts_routed: tuple[tuple[int, ...], ...] = ()
    state_slots: StateSlotsSnapshot | None = None  # a hybrid model's (linear-attention layers)
    speculation: SpeculationSnapshot | None = None
    cache_tiers: CacheTiersSnapshot | None = None

    @property
    def kv_usage_ratio(self) -> float:
        """KV blocks held by requests / all KV blocks (cached-but-free blocks count as free)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0  # (0: not loaded)


class EngineCore(Protocol):
    """What `AsyncEngine` drives on its thread: `LLMEngine` is the one implementation. The face
    holds the engine through this, so the API's imports stop at this module."""

    tokenizer: Tokenizer
    limits: EngineLimits
    last_step_tokens: int  # tokens the last step computed (0: nothing could run)

    def add_request(self, request: EngineRequest) -> None: ...

    def abort(self, group_id: int) -> None: ...

    def pause(self, group_id: int, paused: bool) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> StepOutputs: ...

    def group_ids(self) -> list[int]: ...

    def snapshot(self, steps: int, step_seconds: float, step_hist: Histogram,
                 batch_hist: Histogram) -> EngineSnapshot: ...

    def release_kv(self) -> int: ...  # sleep, level 1 (stopped): the KV cache freed, the weights kept; its bytes
    def restore_kv(self) -> None: ...  # wake: the KV cache (and what is sized for it) built again


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down or crashed); no new request can run."""
