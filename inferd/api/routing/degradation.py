"""Graceful degradation: a sick model's new requests go to its fallback; its classes degrade a level at a time.

A model goes to its `fallback` at once when it is unhealthy, and after `hold_seconds` of persistent
overload (queue-time p95, preemptions a minute or OOMs a minute over a threshold). It comes back only
once healthy and not overloaded have held together for `recover_seconds`. `ModelDegradation.overloaded`
also drives the functional ladder, up one level per hold, down one level per recovery:

    level 0  normal
    level 1  streams are answered whole (one event at the end)
    level 2  ... and max_tokens is capped at a lower ceiling
    level 3  ... and the lowest-priority class is refused

Every condition must hold *without a break*, so an oscillating trigger cannot flap. A healthy model
with one trigger, one `update` a second, one column each; hold_seconds = 3 and recover_seconds = 5,
for the model and for its ladder:

    t          0         1         2         3
               01234567890123456789012345678901
    trigger    .#.##.#####.#.##.#..............
    fallback   .........##############.........
    level      00000000000011122233333333332222
                ^       ^  ^   ^      ^    ^
                |       |  |   |      |    |
                |       |  |   |      |    down one level per 5 s clear
                |       |  |   |      off: healthy and clear from t = 18 to t = 23, without a break
                |       |  |   blips of clear shorter than 5 s never switch it off
                |       |  up one level per 3 s of `overloaded`, up to 3
                |       on: the trigger held from t = 6 to t = 9
                blips shorter than 3 s never switch it on

Pure and synchronous: every method takes `now` (seconds, `time.monotonic` in the server), so
tests drive it with made-up times.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)

LEVELS = ("normal", "whole", "capped", "refuse_lowest")
RATE_WINDOW_SECONDS = 60.0  # preemptions a minute are measured over this sliding window


@dataclass(frozen=True)
class Triggers:
    """Overload thresholds; None turns that trigger off."""

    queue_p95_seconds: float | None = None
    preemptions_per_minute: float | None = None
    ooms_per_minute: float | None = None
    hold_seconds: float = 10.0  # an overload condition must hold this long, without a break, to count
    recover_seconds: float = 30.0  # and be clear this long, without a break, to end

    def __post_init__(self) -> None:
        for key in ("queue_p95_seconds", "preemptions_per_minute", "ooms_per_minute"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise ValueError(f"{key} must be >= 0 or None, got {value}")
        for key in ("hold_seconds", "recover_seconds"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class Signals:
    """One look at a model (from its engine snapshot), taken by the server about once a second."""

    healthy: bool  # probe passes and the engine thread is alive
    queue_p95_seconds: float | None  # the worst class's queue-time p95; None: no samples
    preemptions_total: int  # cumulative count since start
    ooms_last_minute: int  # the engine already counts these per minute


class PersistentCondition:
    """True once `condition` has held for hold_seconds without a break; false again once it has been
    false for recover_seconds without a break. A run starts at the first `update` that saw the new value."""

    def __init__(self, hold_seconds: float, recover_seconds: float) -> None:
        self.hold_seconds = hold_seconds
        self.recover_seconds = recover_seconds
        self.active = False
        self.since: float | None = None  # time of the last change of `active`
        self._run_start: float | None = None  # first update of the current unbroken run of `_run_value`
        self._run_value: bool | None = None

    def update(self, now: float, condition: bool) -> bool:
        if condition != self._run_value:
            self._run_value, self._run_start = condition, now
        assert self._run_start is not None
        needed = self.hold_seconds if condition else self.recover_seconds
        if condition != self.active and now - self._run_start >= needed:
            self.active, self.since = condition, now
        return self.active


class ModelDegradation:
    """Whether new requests for a model go to its fallback, and why."""

    def __init__(self, triggers: Triggers) -> None:
        self.triggers = triggers
        self.use_fallback = False
        self.reason: str | None = None  # None when not degraded
        self.switches = 0  # times use_fallback changed
        self._overload = PersistentCondition(triggers.hold_seconds, triggers.recover_seconds)
        # NOTE: the recovery window: active once healthy and no trigger over (in each sample, not just
        # the persistent flag) have held together for recover_seconds; one bad sample ends it at once.
        self._clear = PersistentCondition(triggers.recover_seconds, 0.0)
        self._preemptions: deque[tuple[float, int]] = deque()  # (time, preemptions_total), oldest first

    @property
    def overloaded(self) -> bool:
        """The persistent overload condition (not health) is active."""
        return self._overload.active

    def update(self, now: float, signals: Signals) -> bool:
        causes = self._overload_causes(now, signals)
        self._overload.update(now, bool(causes))
        clear = self._clear.update(now, signals.healthy and not causes)
        if not signals.healthy:
            why: str | None = "unhealthy"
        elif self.overloaded and causes:
            why = "; ".join(causes)
        else:
            why = None  # recovering, or overloaded but this sample is clear: keep the last reason
        if not self.use_fallback and why is not None:
            self._switch(True, why)
        elif self.use_fallback and why is not None:
            self.reason = why
        elif self.use_fallback and clear:
            self._switch(False, f"healthy and not overloaded for {self.triggers.recover_seconds:g} s")
        return self.use_fallback

    # internals

    def _preemption_rate(self, now: float) -> float:
        """Preemptions a minute over the samples of the last 60 s; 0 with fewer than 2 samples."""
        samples = self._preemptions
        while samples and now - samples[0][0] > RATE_WINDOW_SECONDS:
            samples.popleft()
        if len(samples) < 2 or samples[-1][0] <= samples[0][0]:
            return 0.0
        (t0, n0), (t1, n1) = samples[0], samples[-1]
        return (n1 - n0) * 60.0 / (t1 - t0)

    def _overload_causes(self, now: float, signals: Signals) -> list[str]:
        """What is over its threshold in this sample, in words; empty when nothing is."""
        if self._preemptions and signals.preemptions_total < self._preemptions[-1][1]:
            self._preemptions.clear()  # the counter went back (engine restarted): start the window over
        self._preemptions.append((now, signals.preemptions_total))
        rate = self._preemption_rate(now)
        t, causes = self.triggers, []
        p95 = signals.queue_p95_seconds
        if t.queue_p95_seconds is not None and p95 is not None and p95 > t.queue_p95_seconds:
            causes.append(f"queue time p95 {p95:.1f} s over {t.queue_p95_seconds:.1f} s")
        if t.preemptions_per_minute is not None and rate > t.preemptions_per_minute:
            causes.append(f"{rate:.0f} preemptions a minute over {t.preemptions_per_minute:g}")
        if t.ooms_per_minute is not None and signals.ooms_last_minute > t.ooms_per_minute:
            causes.append(f"{signals.ooms_last_minute} OOMs a minute over {t.ooms_per_minute:g}")
        return causes

    def _switch(self, on: bool, why: str) -> None:
        self.use_fallback = on
        self.reason = why if on else None
        self.switches += 1
        log.warning("fallback %s: %s", "on" if on else "off", why)


class FunctionalDegradation:
    """The ladder. Up one level per hold_seconds of continuous overload, down one level per
    recover_seconds of continuous clear (like inferd/engine/sched/shedding.py: up fast, down slowly).
    Each step's period counts from the later of the run's first update and the last level change."""

    def __init__(self, hold_seconds: float, recover_seconds: float) -> None:
        self.hold_seconds = hold_seconds
        self.recover_seconds = recover_seconds
        self.level = 0
        self.changes = 0  # level changes
        self._run_start: float | None = None  # first update of the current unbroken run of `_run_value`
        self._run_value: bool | None = None
        self._last_change: float | None = None

    @property
    def name(self) -> str:
        return LEVELS[self.level]

    def update(self, now: float, overloaded: bool) -> int:
        if overloaded != self._run_value:
            self._run_value, self._run_start = overloaded, now
        assert self._run_start is not None
        start = self._run_start if self._last_change is None else max(self._run_start, self._last_change)
        if overloaded and self.level < len(LEVELS) - 1 and now - start >= self.hold_seconds:
            self._change(now, self.level + 1, f"overloaded for {now - start:g} s")
        elif not overloaded and self.level > 0 and now - start >= self.recover_seconds:
            self._change(now, self.level - 1, f"clear for {now - start:g} s")
        return self.level

    def stream_whole(self) -> bool:
        return self.level >= 1

    def max_tokens(self, requested: int, ceiling: int) -> int:
        return min(requested, ceiling) if self.level >= 2 else requested

    def refuses(self, class_name: str, lowest_class: str) -> bool:
        return self.level >= 3 and class_name == lowest_class

    def _change(self, now: float, new: int, why: str) -> None:
        old, self.level = self.level, new
        self._last_change = now
        self.changes += 1
        log.warning("degradation level %d (%s) -> %d (%s): %s", old, LEVELS[old], new, LEVELS[new], why)
