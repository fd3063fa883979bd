"""Per-class counters and samples the scheduler keeps for metrics and the status page.

The scheduler (on the engine thread) owns one `SchedulerAccounting` and is its only caller. Other
threads read `ClassSnapshot`s and `RequestSnapshot`s, frozen copies made once per step.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from inferd.engine.policy import PriorityClass, SchedulingPolicy
from inferd.engine.request import Request, RequestStatus

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


@dataclass
class ClassStats:
    """Cumulative accounting of one priority class (counters only grow)."""

    name: str
    queued_token_seconds: float = 0.0  # integral of queued prompt tokens over time
    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache supplied
    generation_tokens: int = 0
    ttft: Samples = field(default_factory=Samples)  # seconds from arrival to the first token
    itl: Samples = field(default_factory=Samples)  # seconds between two tokens of a request
    tpot: Samples = field(default_factory=Samples)  # seconds per output token after the first
    e2e: Samples = field(default_factory=Samples)  # seconds from arrival to the end
    queue_time: Samples = field(default_factory=Samples)  # seconds from arrival to first scheduled
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason
    preemptions: Counter[str] = field(default_factory=Counter)  # by mode: recompute, swap
    timeouts: Counter[str] = field(default_factory=Counter)  # by kind: queue, ttft, token, total
    deadline_misses: Counter[str] = field(default_factory=Counter)  # ttft, tpot (soft targets)


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
    """One tenant's fair share (engine/fairness.py) at the end of a step, for other threads."""

    name: str | None  # None: the requests that name no tenant, as one
    weight: float
    virtual_tokens: float  # its counter: tokens served / weight, lifted on return from idle
    served_tokens: int  # tokens computed for it (prompt and output; recomputation included)
    waiting: int
    running: int


class SchedulerAccounting:
    """The scheduler's counters and latency samples: per class, and totals by kind.

    The scheduler calls one `on_*` method at each event; they write only the stats, except that
    `on_token` also stamps the request's token timeline (from which its samples are taken) and
    marks a token that came too late for a hard timeout.

        schedule()  on_step     queued token-seconds since the last step
        _admit      on_cached   prompt tokens the prefix cache supplied
        _start      on_start    queue time (first scheduled only)
        update()    on_prefill  prompt tokens computed
                    on_token    first/last_token_time, TTFT or ITL, target misses, late tokens
        _preempt    on_preempt  by mode            _expire  on_timeout  by kind
        finish()    on_finish   by finish reason; e2e and TPOT
    """

    def __init__(self, policy: SchedulingPolicy, now: float,
                 observe_ttft: Callable[[str, float, float], None]) -> None:
        self._classes = policy.ranked
        self.stats = {c.name: ClassStats(c.name) for c in policy.ranked}
        self.preemptions: Counter[str] = Counter()  # by mode, all classes
        self.timeouts: Counter[str] = Counter()  # by kind, all classes
        self._observe_ttft = observe_ttft  # the load shedder's feed: (class name, ttft, now)
        self._last_step = now

    def on_step(self, now: float, waiting: Iterable[Request]) -> None:
        """Integrate queued tokens over the time since the last step."""
        dt = now - self._last_step
        self._last_step = now
        if dt <= 0:
            return
        for req in waiting:
            self.stats[req.priority_class.name].queued_token_seconds += (req.num_tokens - req.num_computed_tokens) * dt

    def on_cached(self, req: Request, cached: int) -> None:
        self.stats[req.priority_class.name].cached_prompt_tokens += cached

    def on_start(self, req: Request, now: float) -> None:
        self.stats[req.priority_class.name].queue_time.add(now - req.arrival_time)

    def on_prefill(self, req: Request, start: int) -> None:
        """A chunk from prompt position `start` ran; `req.num_computed_tokens` already counts it."""
        self.stats[req.priority_class.name].prompt_tokens += min(req.num_computed_tokens, len(req.prompt_ids)) - start

    def on_token(self, req: Request, now: float) -> None:
        """Record a new token of `req`. One that came later than its TTFT or per-token timeout
        allows sets `req.timeout_kind`: it is still delivered, and the request ends at the next
        schedule()."""
        cls = req.priority_class
        stats = self.stats[cls.name]
        stats.generation_tokens += 1
        t = req.timeouts
        if req.first_token_time is None:
            req.first_token_time = req.last_token_time = now
            ttft = now - req.arrival_time
            stats.ttft.add(ttft)
            self._observe_ttft(cls.name, ttft, now)
            if ttft > cls.ttft_target:
                stats.deadline_misses["ttft"] += 1
            if t.ttft is not None and ttft > t.ttft:
                req.timeout_kind = "ttft"
            return
        gap = now - req.last_token_time  # type: ignore[operator]
        req.last_token_time = now
        stats.itl.add(gap)
        if t.token is not None and gap > t.token:
            req.timeout_kind = "token"

    def on_preempt(self, req: Request, mode: str) -> None:
        self.preemptions[mode] += 1
        self.stats[req.priority_class.name].preemptions[mode] += 1

    def on_timeout(self, req: Request, kind: str) -> None:
        self.timeouts[kind] += 1
        self.stats[req.priority_class.name].timeouts[kind] += 1

    def on_finish(self, req: Request, status: RequestStatus, now: float) -> None:
        stats = self.stats[req.priority_class.name]
        stats.finished[status.finish_reason or status.name] += 1
        stats.e2e.add(now - req.arrival_time)
        n_out = len(req.output_ids)
        if n_out > 1 and req.first_token_time is not None and req.last_token_time is not None:
            tpot = (req.last_token_time - req.first_token_time) / (n_out - 1)
            stats.tpot.add(tpot)
            if tpot > req.priority_class.tpot_target:
                stats.deadline_misses["tpot"] += 1

    def snapshot(self, now: float, waiting: Iterable[Request], running: Iterable[Request],
                 block_table: Callable[[int], Sequence[int]]) -> list[ClassSnapshot]:
        """Every class's state now, most important first (O(waiting + running))."""
        num_waiting: Counter[str] = Counter()
        queued: Counter[str] = Counter()
        oldest: dict[str, float] = {}
        for req in waiting:
            name = req.priority_class.name
            num_waiting[name] += 1
            queued[name] += req.num_tokens - req.num_computed_tokens
            oldest[name] = max(oldest.get(name, 0.0), now - req.arrival_time)
        num_running: Counter[str] = Counter()
        blocks: Counter[str] = Counter()
        for req in running:
            num_running[req.priority_class.name] += 1
            blocks[req.priority_class.name] += len(block_table(req.seq_id))
        return [
            _class_snapshot(cls, self.stats[cls.name], num_waiting[cls.name], queued[cls.name],
                            oldest.get(cls.name, 0.0), num_running[cls.name], blocks[cls.name])
            for cls in self._classes
        ]


def requests_snapshot(requests: Iterable[Request], now: float) -> list[RequestSnapshot]:
    """A `RequestSnapshot` of each of `requests`, in order."""
    out = []
    for req in requests:
        state = "running" if req.status == RequestStatus.RUNNING else "swapped" if req.swapped else "waiting"
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        out.append(RequestSnapshot(req.group_id, req.index, req.priority_class.name, state,
                                   now - req.arrival_time, len(req.prompt_ids), len(req.output_ids), ttft,
                                   req.tenant))
    return out


def _class_snapshot(cls: PriorityClass, s: ClassStats, waiting: int, queued: int, oldest: float,
                    running: int, blocks: int) -> ClassSnapshot:
    return ClassSnapshot(
        name=cls.name, priority=cls.priority, waiting=waiting, queued_tokens=queued, oldest_wait=oldest,
        running=running, kv_blocks_used=blocks, queued_token_seconds=s.queued_token_seconds,
        prompt_tokens=s.prompt_tokens, cached_prompt_tokens=s.cached_prompt_tokens,
        generation_tokens=s.generation_tokens, ttft_p50=s.ttft.percentile(50), ttft_p95=s.ttft.percentile(95),
        tpot_p50=s.tpot.percentile(50), queue_time_p95=s.queue_time.percentile(95),
        finished=dict(s.finished), preemptions=dict(s.preemptions), timeouts=dict(s.timeouts),
        deadline_misses=dict(s.deadline_misses),
        histograms={name: getattr(s, name).histogram.copy() for name in ("ttft", "itl", "tpot", "e2e", "queue_time")},
    )


class Throughput:
    """Tokens per second, recent and per second over the last minute, from cumulative counts
    that the engine thread samples as it publishes its stats; read from any thread."""

    HISTORY_SECONDS = 60
    RESOLUTION = 0.25  # seconds between kept samples

    def __init__(self) -> None:
        # (time, generation tokens, prompt tokens) so far; at most one per RESOLUTION
        self._samples: deque[tuple[float, int, int]] = deque(
            maxlen=int((self.HISTORY_SECONDS + 2) / self.RESOLUTION))

    def sample(self, now: float, generation_tokens: int, prompt_tokens: int) -> None:
        if self._samples and now - self._samples[-1][0] < self.RESOLUTION:
            self._samples[-1] = (self._samples[-1][0], generation_tokens, prompt_tokens)
        else:
            self._samples.append((now, generation_tokens, prompt_tokens))

    def _at(self, samples: list[tuple[float, int, int]], t: float) -> tuple[int, int]:
        """The counts as of time t: the newest sample at or before it (0 before any)."""
        i = bisect.bisect_right(samples, t, key=lambda s: s[0])
        return (samples[i - 1][1], samples[i - 1][2]) if i else (0, 0)

    def rates(self, now: float, window: float = 10.0) -> tuple[float, float]:
        """(generation, prompt) tokens per second over the last `window` seconds."""
        samples = list(self._samples)  # (a copy: the engine thread appends meanwhile)
        if not samples:
            return 0.0, 0.0
        start = max(now - window, samples[0][0])
        if now <= start:
            return 0.0, 0.0
        (g0, p0), (g1, p1) = self._at(samples, start), self._at(samples, now)
        return (g1 - g0) / (now - start), (p1 - p0) / (now - start)

    def history(self, now: float) -> list[float]:
        """Generation tokens in each of the last 60 whole seconds, oldest first."""
        samples = list(self._samples)
        counts = [self._at(samples, now - k)[0] for k in range(self.HISTORY_SECONDS, -1, -1)]
        return [float(b - a) for a, b in zip(counts, counts[1:])]
