"""Scheduling policy as data: priority classes, their limits and timeouts, and load shedding.

The settings layer (inferd/settings/config.py) builds these from inferd.toml; the scheduler, the
admission check at the door and the load shedder read them. Nothing here changes at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TIMEOUT_KINDS = ("queue", "ttft", "token", "total")


@dataclass(frozen=True)
class Timeouts:
    """Hard limits in seconds (None: no limit). Each ends the request with finish_reason "timeout".

    queue: from arrival until first scheduled; ttft: from arrival until the first token;
    token: the gap since the previous token (progressive: it restarts with every token);
    total: from arrival until the last token.
    """

    queue: float | None = None
    ttft: float | None = None
    token: float | None = None
    total: float | None = None

    def tightened(self, other: Timeouts) -> Timeouts:
        """Each limit the tighter of the two: a request may tighten its class's limits, never
        loosen them."""
        return Timeouts(*(_tighter(getattr(self, k), getattr(other, k)) for k in TIMEOUT_KINDS))


def _tighter(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


@dataclass(frozen=True)
class PriorityClass:
    """One priority class. Lower `priority` runs first; requests name a class by name or number.
    The fields are a [classes.NAME] table's keys (settings/engine.py's ClassSettings describes each)."""

    name: str
    priority: int
    max_waiting: int = 256
    max_queued_tokens: int = 65536
    ttft_target: float = 2.0
    tpot_target: float = 0.5
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_tokens: int = 4096
    kv_reserve: float = 0.0
    sheddable: bool = False


DEFAULT_CLASSES = (
    PriorityClass("interactive", 0, max_waiting=256, max_queued_tokens=65536, ttft_target=2.0,
                  tpot_target=0.5, timeouts=Timeouts(queue=60.0, token=60.0, total=900.0)),
    PriorityClass("batch", 1, max_waiting=1024, max_queued_tokens=1 << 20, ttft_target=60.0,
                  tpot_target=2.0, timeouts=Timeouts(queue=1800.0, total=7200.0), kv_reserve=0.1,
                  sheddable=True),
)


@dataclass(frozen=True)
class ShedConfig:
    """The load shedder: when a protected (non-sheddable) class's p95 TTFT over the last
    `window_seconds` nears its target, shed the sheddable classes one level at a time:

        level 1: new requests of sheddable classes get 429
        level 2: ... and they run at most `max_running` sequences (the rest are preempted)
        level 3: ... and their max_tokens is lowered to `max_tokens`

    The fields are the [shedding] table's keys (settings/engine.py's SheddingSettings describes each).
    """

    enabled: bool = True
    margin: float = 0.2
    window_seconds: float = 10.0
    min_samples: int = 5
    escalate_seconds: float = 5.0
    recover_seconds: float = 15.0
    max_running: int = 4
    max_tokens: int = 64


@dataclass(frozen=True)
class SchedulingPolicy:
    """The classes and how the scheduler orders them. The other fields are the [scheduler] table's
    keys of the same names (settings/engine.py's SchedulerSettings describes each)."""

    classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES
    default_class: str = "interactive"
    pooling_class: str | None = None  # (None: the least important class)
    pooling_step_tokens: int = 16  # pooling requests' prompt tokens per step at most
    aging_seconds: float = 60.0
    preemption_mode: str = "recompute"
    fairness: str = "vtc"
    shedding: ShedConfig = field(default_factory=ShedConfig)

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if not names:
            raise ValueError("at least one priority class is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"priority class names must be unique, got {names}")
        priorities = [c.priority for c in self.classes]
        if len(set(priorities)) != len(priorities):
            raise ValueError(f"priority class numbers must be unique, got {priorities}")
        if self.default_class not in names:
            raise ValueError(f"default_class {self.default_class!r} is not a class; classes: {names}")
        if self.pooling_class is not None and self.pooling_class not in names:
            raise ValueError(f"pooling_class {self.pooling_class!r} is not a class; classes: {names}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.fairness not in ("vtc", "fcfs"):
            raise ValueError(f"fairness must be 'vtc' or 'fcfs', got {self.fairness!r}")

    @property
    def ranked(self) -> tuple[PriorityClass, ...]:
        """The classes, most important first."""
        return tuple(sorted(self.classes, key=lambda c: c.priority))

    @property
    def pooling_default(self) -> str:
        """The class of a pooling request (embeddings, rerank, score) that names none."""
        return self.pooling_class or self.ranked[-1].name

    def lookup(self, priority: str | int | None) -> PriorityClass:
        """The class a request's `priority` names (a class name or number); KeyError if none."""
        if priority is None:
            priority = self.default_class
        for c in self.classes:
            if (c.name == priority) if isinstance(priority, str) else (c.priority == priority):
                return c
        raise KeyError(priority)
