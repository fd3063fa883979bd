"""Admission at the door with a fake clock: bounds, all-or-nothing, a concurrent burst, Retry-After
from made-up departures, draining, shedding and the predicted-TTFT deadline, with exact numbers."""

from __future__ import annotations

import asyncio

from collections import Counter

import pytest

from inferd.api.admission.queues import (DRAINING_RETRY_AFTER, UNMEASURED_RETRY_AFTER, ClassQueues,
                                     AdmissionError)
from inferd.settings.policy import PriorityClass


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


CLASSES = (
    PriorityClass("interactive", 0, max_waiting=4, max_queued_tokens=100),
    PriorityClass("batch", 1, max_waiting=1000, max_queued_tokens=1000, sheddable=True),
)


def make(classes=CLASSES, window_seconds: float = 30.0) -> tuple[ClassQueues, FakeClock]:
    clock = FakeClock()
    return ClassQueues(classes, clock=clock, window_seconds=window_seconds), clock


def refused(adm: ClassQueues, *args, **kwargs) -> AdmissionError:
    with pytest.raises(AdmissionError) as info:
        adm.enter(*args, **kwargs)
    return info.value


def test_bounded_by_requests():
    adm, _ = make()
    for _ in range(4):
        adm.enter("interactive", 1, 10)
    assert adm.queued("interactive") == (4, 40)
    err = refused(adm, "interactive", 1, 10)
    assert (err.status, err.reason, err.class_name) == (429, "queue_full", "interactive")
    assert not err.oversized
    assert "'interactive'" in err.message
    assert "4 requests waiting + 1 new > max_waiting 4" in err.message
    assert str(err) == err.message
    assert adm.queued("interactive") == (4, 40)
    assert adm.queued("batch") == (0, 0)


def test_bounded_by_prompt_tokens():
    adm, _ = make()
    adm.enter("interactive", 1, 60)
    adm.enter("interactive", 1, 40)
    err = refused(adm, "interactive", 1, 1)
    assert (err.status, err.reason) == (429, "queue_tokens")
    assert "100 prompt tokens waiting + 1 new > max_queued_tokens 100" in err.message
    assert adm.queued("interactive") == (2, 100)
    adm.enter("interactive", 1, 0)  # a request with no prompt tokens still fits
    assert adm.queued("interactive") == (3, 100)


def test_a_multi_request_admit_is_all_or_nothing():
    adm, _ = make()
    adm.enter("interactive", 3, 30)
    assert refused(adm, "interactive", 2, 20).reason == "queue_full"
    assert adm.queued("interactive") == (3, 30)
    assert refused(adm, "interactive", 1, 71).reason == "queue_tokens"  # requests fit, tokens not
    assert adm.queued("interactive") == (3, 30)
    adm.enter("interactive", 1, 70)
    assert adm.queued("interactive") == (4, 100)


def test_a_request_larger_than_the_queue_says_so():
    adm, _ = make()
    err = refused(adm, "interactive", 5, 10)
    assert (err.status, err.reason, err.oversized) == (429, "queue_full", True)
    assert "can never be admitted" in err.message and "max_waiting 4" in err.message
    err = refused(adm, "interactive", 1, 101)
    assert (err.status, err.reason, err.oversized) == (429, "queue_tokens", True)
    assert "101 prompt tokens in one request" in err.message
    assert adm.queued("interactive") == (0, 0)


@pytest.mark.parametrize("per_call", [1, 3])
def test_a_concurrent_burst_never_exceeds_the_bounds(per_call):
    # the door admits on the event loop: 16 handlers interleaving at every await
    classes = (PriorityClass("interactive", 0, max_waiting=100, max_queued_tokens=10**9),)
    adm, _ = make(classes)
    handlers, calls = 16, 50
    successes = [0] * handlers

    async def burst(i: int) -> None:
        for _ in range(calls):
            await asyncio.sleep(0)
            try:
                adm.enter("interactive", per_call, 7 * per_call)
                successes[i] += 1
            except AdmissionError:
                pass

    async def main() -> None:
        await asyncio.gather(*(burst(i) for i in range(handlers)))

    asyncio.run(main())
    admitted = 100 // per_call
    assert sum(successes) == admitted
    assert adm.queued("interactive") == (admitted * per_call, admitted * 7 * per_call)
    assert adm.rejections == {("interactive", "queue_full"): handlers * calls - admitted}


def test_leave_frees_room_and_never_goes_negative():
    adm, _ = make()
    for _ in range(4):
        adm.enter("interactive", 1, 25)
    adm.leave("interactive", 1, 25)
    assert adm.queued("interactive") == (3, 75)
    adm.enter("interactive", 1, 25)
    with pytest.raises(ValueError):
        adm.leave("interactive", 5, 0)
    with pytest.raises(ValueError):
        adm.leave("interactive", 1, 101)
    with pytest.raises(ValueError):
        adm.leave("interactive", -1, 0)
    assert adm.queued("interactive") == (4, 100)
    adm.leave("interactive", 4, 100)
    assert adm.queued("interactive") == (0, 0)


def test_retry_after_from_the_measured_drain_rate():
    adm, clock = make()
    for _ in range(4):
        adm.enter("interactive", 1, 10)
    for t in (20.0, 21.0, 22.0):  # three leave, three more take their place
        clock.now = t
        adm.leave("interactive", 1, 10)
        adm.enter("interactive", 1, 10)
    clock.now = 30.0
    # 3 requests left in the last 30 s: 0.1/s; 2 over the bound -> 20 s
    assert refused(adm, "interactive", 2, 10).retry_after == 20
    clock.now = 50.5  # the departure at 20 is out of the window: 2 in 30 s, 1 over -> 15 s
    err = refused(adm, "interactive", 1, 10)
    assert err.retry_after == 15 and "retry in 15 s" in err.message
    clock.now = 52.5  # 0 departures in the window
    assert refused(adm, "interactive", 1, 10).retry_after == UNMEASURED_RETRY_AFTER


def test_retry_after_from_the_token_drain_rate():
    adm, clock = make()
    adm.enter("batch", 10, 1000)
    clock.now = 30.0
    adm.leave("batch", 3, 300)  # 300 tokens in 30 s: 10 tokens/s
    adm.enter("batch", 3, 300)
    err = refused(adm, "batch", 1, 50)
    assert (err.reason, err.retry_after) == ("queue_tokens", 5)


def test_retry_after_early_on_measures_over_the_time_since_start():
    adm, clock = make()
    clock.now = 100.0  # Admission was made at 100
    adm = ClassQueues(CLASSES, clock=clock)
    adm.enter("interactive", 4, 40)
    clock.now = 104.0
    adm.leave("interactive", 2, 20)  # 2 requests in the 4 s measured: 0.5/s
    adm.enter("interactive", 2, 20)
    assert refused(adm, "interactive", 1, 10).retry_after == 2


def test_retry_after_is_clamped():
    adm, clock = make()
    adm.enter("batch", 1000, 1000)
    clock.now = 30.0
    adm.leave("batch", 1, 1)  # 1 request in 30 s
    adm.enter("batch", 1, 1)
    assert refused(adm, "batch", 1, 0).retry_after == 30  # 1 over
    assert refused(adm, "batch", 500, 0).retry_after == 60  # 500 over: 15000 s
    clock.now = 31.0
    adm.leave("batch", 999, 0)  # 1000 requests in 30 s: 1 over -> 0.03 s -> 1
    adm.enter("batch", 999, 0)
    assert refused(adm, "batch", 1, 0).retry_after == 1


def test_retry_after_defaults_when_nothing_has_left():
    adm, clock = make()
    adm.enter("interactive", 4, 40)
    clock.now = 1000.0
    err = refused(adm, "interactive", 1, 0)
    assert err.retry_after == UNMEASURED_RETRY_AFTER == 10


def test_draining_refuses_everything_with_503():
    adm, _ = make()
    adm.enter("interactive", 4, 40)
    for name, shed_level in (("interactive", 0), ("batch", 3)):  # checked before shed and bounds
        err = refused(adm, name, 1, 10, draining=True, shed_level=shed_level)
        assert (err.status, err.reason, err.retry_after) == (503, "draining", DRAINING_RETRY_AFTER)
        assert f"'{name}'" in err.message
    adm.leave("interactive", 4, 40)  # what was admitted still leaves
    assert adm.queued("interactive") == (0, 0)


def test_shedding_refuses_only_sheddable_classes():
    adm, _ = make()
    adm.enter("batch", 1, 10, shed_level=0)
    err = refused(adm, "batch", 1, 10, shed_level=1, recover_seconds=7.2)
    assert (err.status, err.reason, err.retry_after) == (429, "shed", 8)
    assert "'batch'" in err.message and "level 1" in err.message
    assert refused(adm, "batch", 1, 10, shed_level=3).retry_after == 10  # the default
    assert refused(adm, "batch", 1, 10, shed_level=2, recover_seconds=0.0).retry_after == 1
    adm.enter("interactive", 1, 10, shed_level=3)
    assert adm.queued("batch") == (1, 10) and adm.queued("interactive") == (1, 10)


def three_classes() -> tuple[ClassQueues, FakeClock]:
    big = dict(max_waiting=100, max_queued_tokens=100_000)
    return make((PriorityClass("hi", 0, **big), PriorityClass("mid", 1, **big),
                 PriorityClass("lo", 2, **big)))


def test_deadline_from_the_predicted_ttft():
    adm, _ = three_classes()
    adm.enter("hi", 1, 2000)
    adm.enter("mid", 1, 1000)
    adm.enter("lo", 1, 5000)
    assert adm.predicted_ttft("mid", 500) is None  # no rate measured yet
    adm.enter("mid", 1, 0, ttft_deadline=0.0)  # ... so the deadline is never checked
    adm.record_prefill(1000, 1.0)  # 1000 prompt tokens/s
    assert adm.prefill_rate() == 1000.0
    # hi and mid's queues count, lo's doesn't: (2000 + 1000 + 500) / 1000
    assert adm.predicted_ttft("mid", 500) == 3.5
    assert adm.predicted_ttft("hi", 0) == 2.0
    assert adm.predicted_ttft("lo", 1000) == 9.0
    err = refused(adm, "mid", 1, 500, ttft_deadline=3.0)
    assert (err.status, err.reason, err.retry_after) == (429, "deadline", 1)  # ceil(0.5)
    assert "'mid'" in err.message and "3.5 s" in err.message and "3.0 s" in err.message
    assert adm.queued("mid") == (2, 1000)
    adm.enter("mid", 1, 500, ttft_deadline=3.5)  # not over the deadline
    assert adm.predicted_ttft("hi", 0) == 2.0  # mid's new tokens don't delay hi
    assert refused(adm, "lo", 1, 500, ttft_deadline=1.0).retry_after == 8  # 9.0 - 1.0
    assert refused(adm, "lo", 1, 500, ttft_deadline=-100.0).retry_after == 60  # clamped


def test_prefill_rate_over_the_window():
    adm, clock = three_classes()
    adm.record_prefill(0, 0.5)  # decode-only step: ignored
    adm.record_prefill(10, 0.0)
    assert adm.prefill_rate() is None
    adm.record_prefill(1000, 1.0)
    adm.record_prefill(3000, 1.0)
    assert adm.prefill_rate() == 2000.0
    clock.now = 10.0
    for _ in range(8):
        adm.record_prefill(500, 1.0)
    assert adm.prefill_rate() == 8000 / 10
    clock.now = 100.0  # all old, but the newest 8 steps are kept: the rate survives idling
    assert adm.prefill_rate() == 500.0
    with pytest.raises(ValueError):
        adm.record_prefill(-1, 1.0)


def test_rejections_are_counted_by_class_and_reason():
    adm, _ = make()
    adm.enter("interactive", 3, 40)
    for _ in range(3):
        refused(adm, "interactive", 2, 0)
    refused(adm, "interactive", 1, 61)
    refused(adm, "batch", 1, 1, shed_level=1)
    adm.enter("batch", 1, 990)
    refused(adm, "batch", 1, 11)
    refused(adm, "batch", 1, 1, draining=True)
    assert adm.rejections == {("interactive", "queue_full"): 3, ("interactive", "queue_tokens"): 1,
                              ("batch", "shed"): 1, ("batch", "queue_tokens"): 1,
                              ("batch", "draining"): 1}


def test_rejections_go_to_the_counter_it_is_given():
    counts: Counter[tuple[str, str]] = Counter({("batch", "shed"): 5})  # a model's slot's, from a revision before
    adm = ClassQueues(CLASSES, clock=FakeClock(), rejections=counts)
    refused(adm, "batch", 1, 1, shed_level=1)
    assert counts == {("batch", "shed"): 6} and adm.rejections is counts


def test_unknown_classes_and_bad_counts():
    adm, _ = make()
    for call in (lambda: adm.enter("nope", 1, 1), lambda: adm.leave("nope", 0, 0),
                 lambda: adm.queued("nope"), lambda: adm.predicted_ttft("nope", 1)):
        with pytest.raises(KeyError):
            call()
    with pytest.raises(ValueError):
        adm.enter("interactive", 0, 1)
    with pytest.raises(ValueError):
        adm.enter("interactive", 1, -1)
    with pytest.raises(ValueError):
        AdmissionError(429, "bogus", 1, "interactive", "no")
    assert not adm.rejections
