"""Per-class counters and samples the scheduler keeps for metrics and the status page.

The scheduler (on the engine thread) owns one `SchedulerAccounting` and is its only caller. Other
threads read `ClassSnapshot`s and `RequestSnapshot`s, frozen copies made once per step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from inferd.engine.kv.cache_tiers import PrefixReport
from inferd.engine.protocol import ClassSnapshot, RequestMetrics, RequestSnapshot, Samples
from inferd.engine.sched.request import Request, RequestStatus
from inferd.settings.policy import PriorityClass, SchedulingPolicy


def request_metrics(request: Request, now: float) -> RequestMetrics:
    """How a finished choice went, for its final output."""
    arrival = request.arrival_time if request.arrival_time is not None else now

    def since(t: float | None) -> float | None:
        return None if t is None else t - arrival

    return RequestMetrics(request.priority_class.name if request.priority_class else "-", len(request.prompt_ids),
                          request.num_cached_tokens, len(request.output_ids), since(request.first_scheduled_time),
                          since(request.first_token_time), now - arrival, request.num_preemptions,
                          request.drafted_tokens, request.accepted_tokens, request.host_cached_tokens,
                          request.cache_miss)


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

    def on_cached(self, req: Request, report: PrefixReport) -> None:
        """Its first admission found `report` (kv/cache_tiers.py)."""
        req.num_cached_tokens, req.host_cached_tokens, req.cache_miss = report.cached_tokens, report.host_tokens, report.miss
        self.stats[req.priority_class.name].cached_prompt_tokens += report.cached_tokens

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
                 held_blocks: Callable[[int], int]) -> list[ClassSnapshot]:
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
            blocks[req.priority_class.name] += held_blocks(req.seq_id)
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
