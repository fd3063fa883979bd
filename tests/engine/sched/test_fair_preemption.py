"""Fair share when every seat is taken (VTC with preemption), with a fake clock and made-up tokens:
a tenant below its share of a rank's seats or blocks takes one from the tenant furthest over its
share, classes still first, and the hand-over settles instead of flapping."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fairness import HI, LO, finish_all, make, req, step

from inferd.engine.sched.request import Request, RequestStatus
from inferd.engine.sched.scheduler import Scheduler


def fill(s: Scheduler, clock, tenant: str, first_id: int, count: int, max_tokens: int = 1000,
         prompt_len: int = 8, **kwargs) -> list[Request]:
    return [req(s, clock, first_id + i, tenant, prompt_len=prompt_len, max_tokens=max_tokens, **kwargs)
            for i in range(count)]


def running_by_tenant(s: Scheduler) -> Counter:
    return Counter(r.tenant for r in s.running)


def fair_preemptions(s: Scheduler) -> dict[str | None, int]:
    return {t.name: t.fair_preemptions for t in s.tenants_snapshot()}


@pytest.mark.parametrize("fairness", ["vtc", "fcfs"])
def test_a_light_request_takes_a_seat_from_the_tenant_holding_them_all(fairness: str) -> None:
    s, clock = make(max_num_seqs=8, fairness=fairness)
    heavy = fill(s, clock, "heavy", 1, 16)  # twice the seats: 8 run, 8 wait
    for _ in range(3):
        step(s, clock, 0.1)
    assert running_by_tenant(s) == {"heavy": 8}
    light = req(s, clock, 100, "light", max_tokens=4)
    plan = step(s, clock, 0.1)
    if fairness == "fcfs":
        assert light.status == RequestStatus.WAITING and not plan.preempted
        return
    assert light in plan.started and running_by_tenant(s) == {"heavy": 7, "light": 1}
    [victim] = plan.preempted
    assert victim in heavy and victim.status == RequestStatus.WAITING
    assert fair_preemptions(s) == {"heavy": 1, "light": 0}
    assert s.preemptions["recompute"] == 1
    # light's answer ends; its seat goes back to heavy's oldest waiting request: the victim
    for _ in range(5):
        step(s, clock, 0.1)
    assert light.status == RequestStatus.FINISHED_LENGTH
    assert victim.status == RequestStatus.RUNNING and running_by_tenant(s) == {"heavy": 8}
    finish_all(s)


def test_the_victim_is_the_cheapest_of_the_tenant_furthest_over_its_share() -> None:
    s, clock = make(max_num_seqs=6)
    old = fill(s, clock, "a", 1, 2, prompt_len=40)
    for _ in range(4):
        step(s, clock, 0.1)
    young = fill(s, clock, "a", 10, 2, prompt_len=4)
    mid = fill(s, clock, "b", 20, 2, prompt_len=4)  # b holds its share (6 / 3 = 2): it gives nothing
    step(s, clock, 0.1)
    assert running_by_tenant(s) == {"a": 4, "b": 2}
    c = req(s, clock, 30, "c")
    plan = step(s, clock, 0.1)
    assert c in plan.started and plan.preempted[0] in young and not set(plan.preempted) & {*old, *mid}
    finish_all(s)


def test_at_equal_shares_no_seat_changes_hands() -> None:
    s, clock = make(max_num_seqs=8)
    fill(s, clock, "a", 1, 4)
    fill(s, clock, "b", 10, 4)
    step(s, clock, 0.1)
    assert running_by_tenant(s) == {"a": 4, "b": 4}
    fill(s, clock, "a", 20, 4)
    fill(s, clock, "b", 30, 4)
    for _ in range(20):
        step(s, clock, 0.1)
    assert running_by_tenant(s) == {"a": 4, "b": 4} and s.num_preemptions == 0
    finish_all(s)


def test_a_fractional_share_is_not_rounded_up_into_a_seat() -> None:
    # 5 seats, two tenants: shares 2.5. a 3, b 2: b's third would put it over, so nothing moves
    s, clock = make(max_num_seqs=5)
    fill(s, clock, "a", 1, 3)
    step(s, clock, 0.1)
    fill(s, clock, "b", 10, 4)
    for _ in range(10):
        step(s, clock, 0.1)
    assert running_by_tenant(s) == {"a": 3, "b": 2} and s.num_preemptions == 0
    finish_all(s)


def test_classes_still_come_first() -> None:
    # heavy's interactive requests hold every seat; a batch request of a light tenant waits ...
    s, clock = make(max_num_seqs=4)
    fill(s, clock, "heavy", 1, 8)
    step(s, clock, 0.1)
    light_batch = req(s, clock, 100, "light", cls=LO)
    for _ in range(3):
        step(s, clock, 0.1)
    assert light_batch.status == RequestStatus.WAITING and s.num_preemptions == 0
    # ... while another tenant's interactive request takes a seat (of its rank only)
    light = req(s, clock, 101, "other")
    plan = step(s, clock, 0.1)
    assert light in plan.started and all(v.priority_class is HI for v in plan.preempted)
    finish_all(s)


def test_a_tenant_holding_most_of_the_pool_gives_blocks_to_one_below_its_share() -> None:
    # 64 blocks of 4 tokens; heavy's 3 long prompts hold 60 of them with seats to spare
    s, clock = make(num_blocks=64, max_num_seqs=16, budget=256)
    heavy = fill(s, clock, "heavy", 1, 3, prompt_len=80)
    step(s, clock, 0.1)
    assert s.block_manager.num_free_blocks < 8 and len(s.running) == 3
    light = req(s, clock, 100, "light", prompt_len=24)  # 6 blocks + 1 to grow
    plan = step(s, clock, 0.1)
    assert light in plan.started and [v.tenant for v in plan.preempted] == ["heavy"]
    assert set(plan.preempted) <= set(heavy) and fair_preemptions(s)["heavy"] == 1
    finish_all(s)


def test_both_tenants_saturating_hand_over_few_seats_and_no_request_often() -> None:
    # heavy arrives first and takes every seat; light then keeps a backlog too (closed loops of 64
    # requests each, 16 seats, 30-token answers: a seat frees every ~2 steps). Light climbs to
    # half its share by preemption, then to its share as seats free. Waves of equal answers make
    # admission order swing the split (a tenant first in line takes every seat a wave frees); a
    # tenant left below half its share takes seats back, a handful per wave: bounded by a tenth
    # of the requests served, each preempted at most once.
    s, clock = make(max_num_seqs=16)
    fill(s, clock, "heavy", 1, 64, max_tokens=30)
    step(s, clock, 0.1)
    fill(s, clock, "light", 1000, 64, max_tokens=30)
    next_id, shares, finished, most_preempted = 2000, [], 0, 0
    for _ in range(600):  # a minute
        plan = step(s, clock, 0.1)
        finished += sum(c.request.status == RequestStatus.FINISHED_LENGTH for c in plan.chunks)
        for tenant in ("heavy", "light"):
            while sum(1 for r in [*s.running, *s.waiting] if r.tenant == tenant) < 64:
                req(s, clock, next_id, tenant, max_tokens=30)
                next_id += 1
        shares.append(running_by_tenant(s)["light"])
        most_preempted = max(most_preempted, *(r.num_preemptions for r in s.running))
    taken = fair_preemptions(s)
    assert 1 <= taken["heavy"] and sum(taken.values()) <= finished / 10, (taken, finished)
    assert most_preempted <= 1
    assert 6 <= sum(shares[100:]) / len(shares[100:]) <= 10  # about half the seats, all along
    finish_all(s)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 40), st.integers(1, 12),
                          st.booleans()), min_size=1, max_size=40))
def test_any_mix_keeps_the_pool_whole_and_preempts_no_request_often(arrivals: list) -> None:
    s, clock = make(num_blocks=48, max_num_seqs=6, budget=32)
    for i, (tenant, prompt_len, max_tokens, low) in enumerate(arrivals):
        req(s, clock, i + 1, tenant, prompt_len=prompt_len, max_tokens=max_tokens, cls=LO if low else HI)
        step(s, clock, 0.05)
        s.block_manager.check_invariants()
    for _ in range(400):
        if not s.has_work():
            break
        step(s, clock, 0.05)
    assert not s.has_work()  # every request ended
    assert s.block_manager.num_used_blocks == 0
    assert sum(t.fair_preemptions for t in s.tenants_snapshot()) <= len(arrivals)
