"""Per-class counters and samples the scheduler keeps for metrics and the status page.

The scheduler (on the engine thread) is the only writer. Other threads read `ClassSnapshot`s,
frozen copies made once per step.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

SAMPLE_WINDOW = 1024  # recent samples kept per series (for percentiles on the status page)


@dataclass
class Samples:
    """A latency series: count and sum since start, plus the most recent values."""

    count: int = 0
    total: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
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
    tpot: Samples = field(default_factory=Samples)  # seconds per output token after the first
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
