"""The load shedder driven by made-up TTFT samples at made-up times, with exact assertions on
its p95, its level after every update, and the level changes it records."""

from __future__ import annotations

import logging

import pytest

from inferd.engine.sched import shedding
from inferd.settings.policy import DEFAULT_CLASSES, PriorityClass, ShedConfig
from inferd.engine.sched.shedding import LoadShedder, percentile95

HOT, CLEAR = 5.0, 0.1  # TTFT seconds: far over / under interactive's 0.8 * 2.0 s threshold


def make(**overrides) -> LoadShedder:
    cfg = dict(margin=0.2, window_seconds=30.0, min_samples=5, escalate_seconds=2.0,
               recover_seconds=10.0)
    cfg.update(overrides)
    return LoadShedder(ShedConfig(**cfg), DEFAULT_CLASSES)


def drive(shedder: LoadShedder, signal: str, start: int = 0, class_name: str = "interactive") -> str:
    """One tick per second: at tick t, min_samples samples (HOT for '#', CLEAR for '.') arrive,
    then `update`. The window must be under a second so each tick sees only its own samples.
    Returns the levels after each tick as a string like signal."""
    assert shedder.config.window_seconds < 1.0
    levels = ""
    for i, s in enumerate(signal):
        t = float(start + i)
        for _ in range(shedder.config.min_samples):
            shedder.observe(class_name, HOT if s == "#" else CLEAR, t)
        levels += str(shedder.update(t))
    return levels


def changes(shedder: LoadShedder) -> list[tuple[float, int, int]]:
    return [(t, old, new) for t, old, new, _ in shedder.history]


def test_percentile95_is_nearest_rank():
    assert percentile95([7.0]) == 7.0
    assert percentile95([float(i) for i in range(1, 21)]) == 19.0  # ceil(0.95 * 20) = 19th
    assert percentile95([float(i) for i in range(100, 0, -1)]) == 95.0
    assert percentile95([1.0, 1.0, 1.0, 1.0, 9.0]) == 9.0  # ceil(4.75) = 5th of 5


def test_p95_over_the_window_and_expiry():
    s = make(window_seconds=10.0)
    for t, ttft in enumerate([9.0, 1.0, 1.0, 1.0]):
        s.observe("interactive", ttft, float(t))
    assert s.p95("interactive", 4.0) is None  # 4 < min_samples
    s.observe("interactive", 2.0, 4.0)
    assert s.p95("interactive", 4.0) == 9.0
    assert s.p95("interactive", 10.0) == 9.0  # the sample at t=0 is exactly window_seconds old
    assert s.p95("interactive", 10.5) is None  # it expired: 4 left
    s.observe("interactive", 3.0, 10.5)
    assert s.p95("interactive", 10.5) == 3.0  # [1, 1, 1, 2, 3]
    assert s.p95("interactive", 25.0) is None
    assert len(s._windows["interactive"].samples) == 0  # expired samples are dropped
    assert s.p95("batch", 25.0) is None  # any class can be asked; only watched ones count


def test_samples_are_dropped_on_observe_even_without_update():
    s = make(window_seconds=10.0)
    for t in range(1000):
        s.observe("batch", 1.0, float(t))
    assert len(s._windows["batch"].samples) == 11  # t = 989 .. 999


def test_p95_is_cached_until_samples_change_or_expire(monkeypatch):
    calls = []

    def counting(values):
        calls.append(len(values))
        return percentile95(values)

    monkeypatch.setattr(shedding, "percentile95", counting)
    s = make(window_seconds=10.0)
    for i in range(5):
        s.observe("interactive", CLEAR, i * 0.1)
    for step in range(1000):  # an engine step every 5 ms, all inside the window
        s.update(0.5 + step * 0.005)
    assert calls == [5]
    s.observe("interactive", CLEAR, 5.5)
    s.update(5.5)
    s.update(5.6)
    assert calls == [5, 6]
    s.update(10.05)  # the sample at t=0 expires
    assert calls == [5, 6, 5]


def test_escalates_one_level_per_escalate_seconds_up_to_three():
    s = make()
    for _ in range(5):
        s.observe("interactive", 3.0, 0.0)
    levels = [s.update(t) for t in (0.0, 1.0, 1.99, 2.0, 3.0, 4.0, 6.0, 8.0, 20.0)]
    assert levels == [1, 1, 1, 2, 2, 3, 3, 3, 3]
    assert changes(s) == [(0.0, 0, 1), (2.0, 1, 2), (4.0, 2, 3)]
    assert s.actions == {"escalate": 3, "level:1": 1, "level:2": 1, "level:3": 1}
    reason = s.history[0][3]
    assert "'interactive'" in reason and "3.000s > 1.600s" in reason


def test_no_escalation_without_min_samples():
    s = make()
    for _ in range(4):
        s.observe("interactive", 30.0, 0.0)
    assert [s.update(t) for t in (0.0, 5.0, 10.0)] == [0, 0, 0]
    s.observe("interactive", 30.0, 10.0)
    assert s.update(10.0) == 1


def test_hot_means_strictly_over_the_margin():
    s = make()
    for _ in range(5):
        s.observe("interactive", 1.6, 0.0)  # exactly (1 - 0.2) * 2.0
    assert s.update(0.0) == 0
    s.observe("interactive", 1.61, 0.0)
    assert s.update(0.0) == 1


def test_steps_down_one_level_per_recover_period():
    s = make(window_seconds=0.5)
    levels = drive(s, "#####" + "." * 35)
    #                  0         1         2         3
    #                  0123456789012345678901234567890123456789
    assert levels == "1122333333333322222222221111111111000000"
    assert changes(s) == [(0, 0, 1), (2, 1, 2), (4, 2, 3), (14, 3, 2), (24, 2, 1), (34, 1, 0)]
    assert s.actions["recover"] == 3 and s.actions["escalate"] == 3
    assert "clear for 10.0s" in s.history[3][3]


def test_a_hot_blip_restarts_the_clear_period():
    s = make(window_seconds=0.5)
    #                  0         1         2         3         4
    #                  01234567890123456789012345678901234567890123
    levels = drive(s, "#####.....#.........................#.......")
    assert levels == "11223333333333333333222222222211111122222222"
    # at 3, the blip at 10 can't escalate; it moves the first step down from 14 to 20. At 1, the
    # blip at 36 escalates again (the last escalation was long ago) and restarts the period.
    assert changes(s) == [(0, 0, 1), (2, 1, 2), (4, 2, 3), (20, 3, 2), (30, 2, 1), (36, 1, 2)]


@pytest.mark.parametrize("pattern", ["#.", "#..", "##...", "#........", "#..#....#."])
def test_an_oscillating_signal_does_not_flap(pattern):
    s = make(window_seconds=0.5)
    levels = drive(s, pattern * (300 // len(pattern)))
    assert levels.endswith("3" * 250)
    assert len(s.history) == 3  # straight up, then held: every clear stretch is under 10 s
    drive(s, "." * 40, start=300)
    assert len(s.history) == 6 and s.level == 0


def test_history_is_bounded():
    s = make(window_seconds=0.5)
    drive(s, ("#" + "." * 11) * 60)  # up at the blip, down 10 s later: 2 changes per 12 s
    assert s.actions["escalate"] == 60 and s.actions["recover"] == 60
    assert s.actions["level:1"] == 60 and s.actions["level:0"] == 60
    assert len(s.history) == shedding.HISTORY_LEN


def test_any_watched_class_can_make_it_hot_but_sheddable_ones_cannot():
    classes = (PriorityClass("chat", 0, ttft_target=1.0),
               PriorityClass("agent", 1, ttft_target=20.0),
               PriorityClass("batch", 2, ttft_target=1.0, sheddable=True))
    s = LoadShedder(ShedConfig(min_samples=1), classes)
    s.observe("batch", 100.0, 0.0)
    s.observe("agent", 10.0, 0.0)  # under 0.8 * 20
    assert s.update(0.0) == 0
    s.observe("chat", 0.9, 1.0)  # over 0.8 * 1.0
    assert s.update(1.0) == 1
    assert "'chat'" in s.history[0][3] and "0.900s > 0.800s" in s.history[0][3]


@pytest.mark.parametrize("classes, enabled", [
    ((PriorityClass("a", 0), PriorityClass("b", 1)), True),  # nothing to shed
    ((PriorityClass("a", 0, sheddable=True),), True),  # nothing to protect
    (DEFAULT_CLASSES, False),  # disabled
])
def test_stays_at_zero_when_inactive(classes, enabled):
    s = LoadShedder(ShedConfig(enabled=enabled, min_samples=1), classes)
    for t in range(20):
        for c in classes:
            s.observe(c.name, 1000.0, float(t))
        assert s.update(float(t)) == 0
    assert s.level == 0 and not s.history and not s.actions


def test_level_changes_are_logged(caplog):
    s = make(window_seconds=0.5)
    with caplog.at_level(logging.WARNING, logger="inferd.engine.sched.shedding"):
        drive(s, "#" + "." * 10)
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 2
    up, down = (r.getMessage() for r in caplog.records)
    assert "0 -> 1" in up and "'interactive'" in up and "5.000s > 1.600s" in up
    assert "1 -> 0" in down and "'interactive'" in down and "0.100s <= 1.600s" in down


def test_unknown_class_is_a_key_error():
    s = make()
    with pytest.raises(KeyError):
        s.observe("nope", 1.0, 0.0)
    with pytest.raises(KeyError):
        s.p95("nope", 0.0)
