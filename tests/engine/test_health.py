"""The engine's health with a fake clock: failed steps in a row, the window, the recovery time."""

from __future__ import annotations

from inferd.engine.health import EngineHealth


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_two_failed_steps_in_a_row_within_the_window_make_it_unhealthy_until_it_recovers() -> None:
    clock = FakeClock()
    health = EngineHealth(window_seconds=30.0, recover_seconds=10.0, clock=clock)
    health.forward_failed()
    assert health.healthy and health.consecutive == 1
    clock.now += 5
    health.forward_failed()
    assert not health.healthy and health.consecutive == 2
    health.step_ok()
    assert health.consecutive == 0 and not health.healthy  # recovering: no flapping back at once
    clock.now += 9.9
    assert not health.healthy
    clock.now += 0.1
    assert health.healthy
    assert health.failures == {"forward": 2}


def test_failures_apart_by_more_than_the_window_or_a_good_step_are_not_in_a_row() -> None:
    clock = FakeClock()
    health = EngineHealth(window_seconds=30.0, recover_seconds=10.0, clock=clock)
    health.forward_failed()
    clock.now += 31
    health.forward_failed()  # too long after the first
    assert health.consecutive == 1 and health.healthy
    health.step_ok()
    health.forward_failed()
    assert health.consecutive == 1 and health.healthy
    health.request_failed()  # one request's own failure says nothing about the engine
    assert health.healthy and health.failures == {"forward": 3, "request": 1}


def test_out_of_memory_events_are_counted_over_the_last_minute() -> None:
    clock = FakeClock()
    health = EngineHealth(window_seconds=30.0, recover_seconds=10.0, clock=clock)
    for _ in range(3):
        health.out_of_memory()
        clock.now += 20
    assert health.ooms_last_minute() == 2  # the first is 60 s old
    clock.now += 60
    assert health.ooms_last_minute() == 0 and health.failures == {"oom": 3} and health.healthy
