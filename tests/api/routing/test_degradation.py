"""Graceful degradation on made-up times: the persistent condition, the fallback switch and the functional
ladder, each fed steady, broken and oscillating inputs."""

from __future__ import annotations

import logging

import pytest

from inferd.api.routing.degradation import (
    LEVELS,
    FunctionalDegradation,
    ModelDegradation,
    PersistentCondition,
    Signals,
    Triggers,
)


def ticks(start: float, stop: float, step: float = 1.0) -> list[float]:
    """start, start + step, ... up to and excluding stop, without float drift."""
    return [start + i * step for i in range(round((stop - start) / step))]


def ok(p95: float | None = None, preemptions: int = 0, ooms: int = 0, healthy: bool = True) -> Signals:
    return Signals(healthy=healthy, queue_p95_seconds=p95, preemptions_total=preemptions, ooms_last_minute=ooms)


# ----------------------------------------------------------------------------------- PersistentCondition


def test_condition_activates_after_holding() -> None:
    c = PersistentCondition(hold_seconds=3, recover_seconds=5)
    assert [c.update(t, True) for t in (0, 1, 2)] == [False, False, False]
    assert c.update(3, True) is True
    assert c.active and c.since == 3


def test_condition_break_before_hold_resets() -> None:
    c = PersistentCondition(hold_seconds=3, recover_seconds=5)
    c.update(0, True)
    c.update(2, True)
    assert c.update(2.5, False) is False  # a break: the hold starts over
    assert c.update(3, True) is False
    assert c.update(5.5, True) is False
    assert c.update(6, True) is True


def test_condition_recovery_needs_continuous_clear() -> None:
    c = PersistentCondition(hold_seconds=0, recover_seconds=5)
    assert c.update(0, True) is True
    assert c.update(1, False) is True
    assert c.update(5, False) is True
    assert c.update(5.5, True) is True  # a blip: the clear period starts over
    assert c.update(6, False) is True
    assert c.update(10.5, False) is True
    assert c.update(11, False) is False
    assert c.since == 11


def test_condition_oscillating_never_activates() -> None:
    c = PersistentCondition(hold_seconds=3, recover_seconds=5)
    seen = {c.update(t, int(t) % 2 == 0) for t in ticks(0, 100, 0.25)}  # on 1 s, off 1 s
    assert seen == {False}
    assert c.since is None


def test_condition_activated_then_oscillating_never_deactivates() -> None:
    c = PersistentCondition(hold_seconds=3, recover_seconds=5)
    for t in ticks(0, 4):
        c.update(t, True)
    assert c.active
    seen = {c.update(t, int(t) % 2 == 0) for t in ticks(4, 104, 0.25)}
    assert seen == {True}
    assert c.since == 3


# ----------------------------------------------------------------------------------- ModelDegradation


def test_unhealthy_goes_to_fallback_at_once_and_back_after_recovery() -> None:
    m = ModelDegradation(Triggers(recover_seconds=10))
    assert m.update(0, ok()) is False and m.reason is None
    assert m.update(1, ok(healthy=False)) is True
    assert m.reason == "unhealthy"
    assert not m.overloaded
    for t in ticks(2, 12):  # healthy from t = 2: still on until t = 12
        assert m.update(t, ok()) is True
    assert m.update(12, ok()) is False
    assert m.reason is None
    assert m.switches == 2


def test_healthy_blip_inside_recovery_restarts_it() -> None:
    m = ModelDegradation(Triggers(recover_seconds=10))
    m.update(0, ok(healthy=False))
    for t in ticks(1, 9):
        m.update(t, ok())
    assert m.update(9, ok(healthy=False)) is True
    for t in ticks(10, 20):
        assert m.update(t, ok()) is True
    assert m.update(20, ok()) is False


def test_health_oscillating_every_2_s_switches_once() -> None:
    m = ModelDegradation(Triggers(recover_seconds=10))
    for t in ticks(0, 120):
        m.update(t, ok(healthy=int(t) // 2 % 2 == 1))  # 2 s healthy, 2 s not
    assert m.use_fallback and m.switches == 1


def test_queue_p95_over_threshold_for_hold_goes_to_fallback_with_numbers() -> None:
    m = ModelDegradation(Triggers(queue_p95_seconds=1.0, hold_seconds=10, recover_seconds=30))
    for t in ticks(0, 10):
        assert m.update(t, ok(p95=2.1)) is False
    assert m.update(10, ok(p95=2.1)) is True
    assert m.overloaded
    assert m.reason == "queue time p95 2.1 s over 1.0 s"


def test_queue_p95_shorter_than_hold_stays_off() -> None:
    m = ModelDegradation(Triggers(queue_p95_seconds=1.0, hold_seconds=10))
    for t in ticks(0, 9):
        m.update(t, ok(p95=2.1))
    for t in ticks(9, 60):
        assert m.update(t, ok(p95=0.5)) is False
    assert not m.overloaded and m.switches == 0 and m.reason is None


def test_overload_ends_after_recovery_without_a_break() -> None:
    m = ModelDegradation(Triggers(queue_p95_seconds=1.0, hold_seconds=5, recover_seconds=10))
    for t in ticks(0, 6):
        m.update(t, ok(p95=3.0))
    assert m.use_fallback
    for t in ticks(6, 16):
        assert m.update(t, ok(p95=None)) is True  # no samples counts as clear
    assert m.update(16, ok(p95=0.2)) is False
    assert not m.overloaded and m.switches == 2


def test_preemption_rate_over_threshold() -> None:
    m = ModelDegradation(Triggers(preemptions_per_minute=10, hold_seconds=10))
    for t in ticks(0, 30):
        m.update(t, ok(preemptions=int(t * 20 / 60)))  # 20 a minute
    assert m.use_fallback
    assert m.reason is not None and "preemptions a minute over 10" in m.reason


def test_preemption_rate_under_threshold_and_old_samples_expire() -> None:
    m = ModelDegradation(Triggers(preemptions_per_minute=10, hold_seconds=10))
    m.update(0, ok(preemptions=0))
    m.update(1, ok(preemptions=100))  # a burst long ago
    for t in ticks(62, 200):
        assert m.update(t, ok(preemptions=100 + int((t - 62) * 5 / 60))) is False  # 5 a minute


def test_ooms_over_threshold() -> None:
    m = ModelDegradation(Triggers(ooms_per_minute=2, hold_seconds=3))
    for t in ticks(0, 4):
        m.update(t, ok(ooms=3))
    assert m.use_fallback and m.reason == "3 OOMs a minute over 2"


def test_triggers_set_to_none_never_fire() -> None:
    m = ModelDegradation(Triggers(hold_seconds=0))
    for t in ticks(0, 120):
        m.update(t, ok(p95=100.0, preemptions=int(t) * 50, ooms=99))
    assert not m.use_fallback and not m.overloaded and m.switches == 0


def test_switches_count_and_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    m = ModelDegradation(Triggers(queue_p95_seconds=1.0, hold_seconds=2, recover_seconds=3))
    with caplog.at_level(logging.WARNING, logger="inferd.api.routing.degradation"):
        m.update(0, ok(healthy=False))
        for t in ticks(1, 5):
            m.update(t, ok())
        for t in ticks(5, 8):
            m.update(t, ok(p95=1.5))
        for t in ticks(8, 12):
            m.update(t, ok())
    assert m.switches == 4 and not m.use_fallback
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4
    assert "unhealthy" in messages[0] and "queue time p95 1.5 s over 1.0 s" in messages[2]


def test_invalid_triggers_name_the_key() -> None:
    with pytest.raises(ValueError, match="hold_seconds"):
        Triggers(hold_seconds=-1)
    with pytest.raises(ValueError, match="queue_p95_seconds"):
        Triggers(queue_p95_seconds=-0.5)


# ----------------------------------------------------------------------------------- FunctionalDegradation


def test_ladder_climbs_one_level_per_hold_and_stops_at_3() -> None:
    f = FunctionalDegradation(hold_seconds=3, recover_seconds=5)
    levels = [f.update(t, True) for t in ticks(0, 20)]
    assert levels[:13] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert set(levels[9:]) == {3}
    assert f.name == "refuse_lowest" and f.changes == 3


def test_ladder_steps_down_one_level_per_recovery() -> None:
    f = FunctionalDegradation(hold_seconds=3, recover_seconds=5)
    for t in ticks(0, 10):
        f.update(t, True)
    assert f.level == 3
    levels = [f.update(t, False) for t in ticks(10, 30)]
    assert levels[:16] == [3] * 5 + [2] * 5 + [1] * 5 + [0]
    assert f.name == "normal" and f.changes == 6


def test_ladder_blip_during_recovery_restarts_the_clear_period() -> None:
    f = FunctionalDegradation(hold_seconds=3, recover_seconds=5)
    for t in ticks(0, 4):
        f.update(t, True)
    assert f.level == 1
    for t in ticks(4, 8):
        f.update(t, False)
    f.update(8, True)  # a blip shorter than the hold: no climb, but the clear period starts over
    assert f.level == 1
    for t in ticks(9, 14):
        assert f.update(t, False) == 1
    assert f.update(14, False) == 0


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_ladder_actions_at_each_level(level: int) -> None:
    f = FunctionalDegradation(hold_seconds=1, recover_seconds=1)
    for t in range(level + 1):
        f.update(t, True)
    assert f.level == level and f.name == LEVELS[level]
    assert f.stream_whole() is (level >= 1)
    assert f.max_tokens(1000, 256) == (256 if level >= 2 else 1000)
    assert f.max_tokens(100, 256) == 100
    assert f.refuses("batch", "batch") is (level >= 3)
    assert f.refuses("interactive", "batch") is False


def test_ladder_oscillating_overload_does_not_flap() -> None:
    f = FunctionalDegradation(hold_seconds=3, recover_seconds=5)
    assert {f.update(t, int(t) % 2 == 0) for t in ticks(0, 100, 0.25)} == {0}  # on 1 s, off 1 s
    assert f.changes == 0
    # on 4 s, off 2 s: it climbs, and never steps down while the oscillation lasts
    levels = [f.update(t, int(t) % 6 < 4) for t in ticks(100, 200, 0.25)]
    assert levels == sorted(levels) and levels[-1] == 3
    # then clear for good: it steps down, never back up; one change of direction in all
    levels += [f.update(t, False) for t in ticks(200, 240, 0.25)]
    turns = sum(1 for a, b, c in zip(levels, levels[1:], levels[2:]) if (b - a) * (c - b) < 0)
    steps = [b - a for a, b in zip(levels, levels[1:]) if b != a]
    assert levels[-1] == 0 and steps == [1, 1, 1, -1, -1, -1] and turns <= 1


def test_ladder_changes_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    f = FunctionalDegradation(hold_seconds=1, recover_seconds=1)
    with caplog.at_level(logging.WARNING, logger="inferd.api.routing.degradation"):
        f.update(0, True)
        f.update(1, True)
        f.update(2, False)
        f.update(3, False)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "degradation level 0 (normal) -> 1 (whole)",
        "degradation level 1 (whole) -> 0 (normal)",
    ]
