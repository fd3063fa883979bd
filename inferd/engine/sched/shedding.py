"""The load shedder: watch the protected classes' TTFT, shed the sheddable ones a level at a time.

The watched classes are the non-sheddable ones. The condition is *hot* when any watched class's
p95 TTFT over the last `window_seconds` exceeds `(1 - margin) * ttft_target`. The engine calls
`update(now)` once per step and applies the level it returns (see `ShedConfig`):

    level 0  normal
    level 1  new requests of sheddable classes get 429
    level 2  ... and they run at most `max_running` sequences
    level 3  ... and their max_tokens is capped at `max_tokens`

Up fast, down slowly (hysteresis), so an oscillating signal cannot make the level flap. One
column per second, escalate_seconds = 2, recover_seconds = 4:

    t      0         1         2
           0123456789012345678901
    hot    .#####..#.............
    level  0112233333332222111100
            ^ ^ ^  ^   ^   ^   ^
            | | |  |   step down one level per 4 s clear, counted from the later of the
            | | |  |   last hot `update` and the last level change
            | | |  a hot blip (already at 3): the clear period restarts from t = 8
            escalate at most once per 2 s, up to 3

Pure and synchronous: every method takes `now` (seconds, `time.monotonic` in the server), so
tests drive it with made-up times.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Sequence

from inferd.engine.protocol import percentile
from inferd.settings.policy import PriorityClass, ShedConfig

log = logging.getLogger(__name__)

MAX_LEVEL = 3
HISTORY_LEN = 100


def percentile95(values: Sequence[float]) -> float:
    return percentile(values, 95)


class _Window:
    """One class's TTFT samples of the last `seconds`, oldest first, and their cached p95."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.samples: deque[tuple[float, float]] = deque()  # (time, ttft), times non-decreasing
        self._p95: float | None = None
        self._stale = False  # samples changed since _p95 was computed

    def add(self, ttft: float, now: float) -> None:
        self.samples.append((now, ttft))
        self._stale = True
        self.expire(now)

    def expire(self, now: float) -> None:
        cutoff = now - self.seconds
        while self.samples and self.samples[0][0] < cutoff:
            self.samples.popleft()
            self._stale = True

    def p95(self, now: float, min_samples: int) -> float | None:
        self.expire(now)
        if len(self.samples) < max(1, min_samples):
            return None
        if self._stale:
            self._p95 = percentile95([ttft for _, ttft in self.samples])
            self._stale = False
        return self._p95


class LoadShedder:
    def __init__(self, config: ShedConfig, classes: Sequence[PriorityClass]) -> None:
        self.config = config
        self.classes = {c.name: c for c in classes}
        self.watched = tuple(c for c in classes if not c.sheddable)
        # NOTE: with nothing to shed, or nothing to protect, shedding can only hurt: stay at 0.
        self.active = config.enabled and bool(self.watched) and any(c.sheddable for c in classes)
        self._windows = {c.name: _Window(config.window_seconds) for c in classes}
        self._level = 0
        self._last_hot: float | None = None
        self._last_change: float | None = None
        self._last_escalation: float | None = None
        self.actions: Counter[str] = Counter()  # "escalate", "recover", "level:N" (entered N)
        self.history: deque[tuple[float, int, int, str]] = deque(maxlen=HISTORY_LEN)

    @property
    def level(self) -> int:
        return self._level

    def observe(self, class_name: str, ttft: float, now: float) -> None:
        """One request of `class_name` got its first token `ttft` seconds after arriving."""
        self._windows[class_name].add(ttft, now)

    def p95(self, class_name: str, now: float) -> float | None:
        """The class's p95 TTFT over the window; None with fewer than `min_samples` samples."""
        return self._windows[class_name].p95(now, self.config.min_samples)

    def update(self, now: float) -> int:
        """Re-evaluate the condition (once per engine step) and return the level to apply."""
        if not self.active:
            return 0
        ratios = self._ratios(now)  # (p95 / threshold, class, p95), worst first
        hot = bool(ratios) and ratios[0][0] > 1.0
        cfg = self.config
        if hot:
            self._last_hot = now
            if self._level < MAX_LEVEL and (self._last_escalation is None
                                            or now - self._last_escalation >= cfg.escalate_seconds):
                self._last_escalation = now
                self._change(now, self._level + 1, "escalate", self._describe(ratios[0], ">"))
        elif self._level > 0:
            clear_since = max(t for t in (self._last_hot, self._last_change) if t is not None)
            if now - clear_since >= cfg.recover_seconds:
                if ratios:
                    why = (f"clear for {now - clear_since:.1f}s; worst "
                           + self._describe(ratios[0], "<="))
                else:
                    why = (f"clear for {now - clear_since:.1f}s; no watched class has "
                           f"{cfg.min_samples} TTFT samples in the last {cfg.window_seconds:g}s")
                self._change(now, self._level - 1, "recover", why)
        return self._level

    # internals

    def _ratios(self, now: float) -> list[tuple[float, PriorityClass, float]]:
        threshold = 1.0 - self.config.margin
        out = []
        for c in self.watched:
            p = self.p95(c.name, now)
            if p is not None:
                out.append((p / (threshold * c.ttft_target), c, p))
        out.sort(key=lambda r: r[0], reverse=True)
        return out

    def _describe(self, ratio: tuple[float, PriorityClass, float], op: str) -> str:
        _, c, p = ratio
        threshold = (1.0 - self.config.margin) * c.ttft_target
        return (f"class {c.name!r} p95 TTFT {p:.3f}s {op} {threshold:.3f}s "
                f"({1.0 - self.config.margin:.0%} of its {c.ttft_target:g}s target)")

    def _change(self, now: float, new: int, action: str, reason: str) -> None:
        old, self._level = self._level, new
        self._last_change = now
        self.actions[action] += 1
        self.actions[f"level:{new}"] += 1
        self.history.append((now, old, new, reason))
        log.warning("load shedding level %d -> %d: %s", old, new, reason)
