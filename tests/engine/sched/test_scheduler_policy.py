"""The scheduling policy with a fake clock and fabricated model outputs (no torch, no model):
class order, deadlines, aging, every timeout kind, preemption victims and modes, priority at
`max_num_seqs`, KV headroom, load shedding as the scheduler applies it, and the prefix cache.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.engine.kv.block_manager import BlockManager
from inferd.settings.policy import PriorityClass, SchedulingPolicy, ShedConfig, Timeouts
from inferd.engine.sched.request import Request, RequestStatus
from inferd.engine.sched.scheduler import Scheduler, SchedulerOutput

from inferd.text.sampling_params import SamplingParams

MAX_MODEL_LEN = 1024

HI = PriorityClass("interactive", 0, ttft_target=1.0)
LO = PriorityClass("batch", 9, ttft_target=30.0, sheddable=True)
MID = PriorityClass("standard", 5, ttft_target=5.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
         classes: tuple[PriorityClass, ...] = (HI, LO), num_host_blocks: int = 0,
         **policy: object) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    policy.setdefault("aging_seconds", 0.0)
    policy.setdefault("default_class", classes[0].name)
    policy.setdefault("shedding", ShedConfig(enabled=False))
    bm = BlockManager(num_blocks, block_size, num_host_blocks=num_host_blocks)
    s = Scheduler(bm, max_num_seqs, budget, SchedulingPolicy(classes=classes, **policy), clock=clock)  # type: ignore[arg-type]
    return s, clock


def req(s: Scheduler, clock: FakeClock, seq_id: int, prompt_len: int, cls: PriorityClass = HI,
        max_tokens: int = 64, timeouts: Timeouts | None = None, prompt: list[int] | None = None) -> Request:
    """A request arriving now, queued."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens = prompt if prompt is not None else [seq_id * 100 + i for i in range(prompt_len)]
    r = Request(seq_id, tokens, params, MAX_MODEL_LEN, priority_class=cls,
                timeouts=timeouts or Timeouts(), arrival_time=clock.now)
    s.add(r)
    return r


def fabricate(plan: SchedulerOutput) -> dict[int, int]:
    """One made-up token per sampling chunk: distinct per request and output position."""
    return {c.request.seq_id: 10_000 * (c.request.seq_id + 1) + len(c.request.output_ids)
            for c in plan.chunks if c.samples}


def step(s: Scheduler, clock: FakeClock | None = None, dt: float = 0.0) -> SchedulerOutput:
    plan = s.schedule()
    if clock is not None:
        clock.now += dt
    s.update(plan, fabricate(plan))
    return plan


def ids(requests) -> list[int]:
    return [r.seq_id for r in requests]


def scheduled(plan: SchedulerOutput) -> list[int]:
    return ids(c.request for c in plan.chunks)


def finish_all(s: Scheduler) -> None:
    for r in [*s.running, *s.waiting]:
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    bm = s.block_manager
    bm.check_invariants()
    # whole: nothing held; cached prefix blocks are all evictable
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.pool.num_blocks
    assert not bm._tables


def expected_outputs(r: Request) -> list[int]:
    return [10_000 * (r.seq_id + 1) + i for i in range(len(r.output_ids))]


# ---------------------------------------------------------------------------------- order


def test_a_higher_class_is_admitted_first_whatever_the_arrival() -> None:
    s, clock = make(budget=8)
    batch = req(s, clock, 0, 8, LO)
    clock.now += 1
    inter = req(s, clock, 1, 8, HI)
    plan = step(s)  # the budget fits one prompt: the interactive one
    assert scheduled(plan) == [1] and ids(s.waiting) == [0]
    plan = step(s)  # then the interactive decode and the batch prompt
    assert scheduled(plan) == [0, 1] and ids(c.request for c in plan.decodes) == [1]
    assert batch.status == RequestStatus.RUNNING and len(inter.output_ids) == 2
    finish_all(s)


def test_three_classes_in_priority_number_order() -> None:
    s, clock = make(budget=4, classes=(LO, MID, HI))
    for i, cls in enumerate((LO, MID, HI, LO, HI)):
        req(s, clock, i, 4, cls)
        clock.now += 0.1
    order = []
    for _ in range(5):
        plan = s.schedule()
        order += [c.request.seq_id for c in plan.prefills]
        s.update(plan, {})  # only prefills matter here; nobody samples (1-token budget after)
        for r in list(s.running):
            s.finish(r, RequestStatus.FINISHED_STOPPED)
    assert order == [2, 4, 1, 0, 3]
    finish_all(s)


def test_earliest_deadline_first_within_a_class() -> None:
    s, clock = make(budget=4)
    relaxed = req(s, clock, 0, 4)  # deadline: arrival + 1.0 (ttft_target)
    clock.now += 0.5
    urgent = req(s, clock, 1, 4, timeouts=Timeouts(ttft=0.2))  # arrival + 0.2: earlier
    plan = step(s)
    assert scheduled(plan) == [1]
    assert relaxed.status == RequestStatus.WAITING and urgent.status == RequestStatus.RUNNING
    finish_all(s)


def test_aging_lifts_a_starved_batch_request_over_newer_interactive_ones() -> None:
    s, clock = make(budget=4, aging_seconds=10.0)
    old = req(s, clock, 0, 4, LO)
    clock.now += 5
    req(s, clock, 1, 4, HI)
    assert scheduled(s.schedule()) == [1]  # 5 s of waiting: still a batch request
    for r in list(s.running):
        s.finish(r, RequestStatus.FINISHED_STOPPED)
    clock.now += 6  # old has waited 11 s: one class up, where deadlines decide: its (30 s) is later
    req(s, clock, 2, 4, HI)
    assert scheduled(s.schedule()) == [2]
    for r in list(s.running):
        s.finish(r, RequestStatus.FINISHED_STOPPED)
    clock.now += 25  # old has waited 36 s: its deadline now comes before a new arrival's
    req(s, clock, 3, 4, HI)
    assert scheduled(s.schedule()) == [0]
    assert old.status == RequestStatus.RUNNING
    finish_all(s)


def test_without_aging_the_batch_request_keeps_waiting() -> None:
    s, clock = make(budget=4, aging_seconds=0.0)
    req(s, clock, 0, 4, LO)
    clock.now += 1000
    req(s, clock, 1, 4, HI)
    assert scheduled(s.schedule()) == [1]
    finish_all(s)



def test_an_aged_request_without_a_seat_does_not_stall_the_running_prefill() -> None:
    """Found by the randomized test: an aged waiting request sorts ahead of a running prefill of
    its own class, cannot preempt it for the only seat, and used to stop the step there, so the
    prefill that held the seat never finished and nothing ran again."""
    s, clock = make(max_num_seqs=1, budget=4, aging_seconds=1.0)
    running = req(s, clock, 0, 14, LO, max_tokens=2)
    assert scheduled(step(s)) == [0]  # 4 of its 14 prompt tokens
    clock.now += 1
    waiting = req(s, clock, 1, 5, LO)
    clock.now += 3  # aged ahead of the running prefill, whose rank does not age
    for _ in range(3):
        assert scheduled(step(s)) == [0]
    assert running.num_computed_tokens == 14 and waiting.status == RequestStatus.WAITING
    finish_all(s)


# ------------------------------------------------------------------------------- timeouts


def test_queue_timeout_ends_a_request_that_was_never_scheduled() -> None:
    s, clock = make(max_num_seqs=1)
    first = req(s, clock, 0, 4)
    queued = req(s, clock, 1, 4, timeouts=Timeouts(queue=2.0))
    step(s)
    clock.now += 1.9
    assert step(s).timed_out == []
    clock.now += 0.2
    plan = step(s)
    assert plan.timed_out == [queued]
    assert queued.status == RequestStatus.FINISHED_TIMEOUT and queued.timeout_kind == "queue"
    assert queued.status.finish_reason == "timeout"
    assert first.status == RequestStatus.RUNNING  # untouched
    assert s.timeouts == {"queue": 1} and s.stats["interactive"].timeouts == {"queue": 1}
    finish_all(s)


def test_ttft_timeout_ends_a_prefill_that_takes_too_long() -> None:
    s, clock = make(budget=4)
    r = req(s, clock, 0, 20, timeouts=Timeouts(ttft=1.0))
    for _ in range(2):  # 4 of 20 prompt tokens per step, 0.45 s per step
        plan = step(s, clock, dt=0.45)
        assert scheduled(plan) == [0]
    plan = step(s, clock, dt=0.45)  # at 0.9 s: still in time, third chunk runs
    assert plan.timed_out == [] and r.num_computed_tokens == 12
    plan = s.schedule()  # 1.35 s and no token yet
    assert plan.timed_out == [r] and plan.chunks == []
    assert r.timeout_kind == "ttft" and r.status == RequestStatus.FINISHED_TIMEOUT
    finish_all(s)


def test_per_token_timeout_restarts_with_every_token() -> None:
    s, clock = make()
    r = req(s, clock, 0, 4, timeouts=Timeouts(token=0.5))
    for _ in range(5):  # 0.4 s per token: each gap is within the limit, the total is not
        assert step(s, clock, dt=0.4).timed_out == []
    assert len(r.output_ids) == 5
    clock.now += 0.6  # a stall: the gap since the last token is now 0.6 s
    plan = s.schedule()
    assert plan.timed_out == [r] and r.timeout_kind == "token"
    finish_all(s)


def test_a_token_that_comes_too_late_is_delivered_then_the_request_ends() -> None:
    s, clock = make()
    r = req(s, clock, 0, 4, timeouts=Timeouts(token=0.5))
    step(s, clock, dt=0.1)
    plan = step(s, clock, dt=0.7)  # this step itself took longer than the limit
    assert plan.timed_out == [] and len(r.output_ids) == 2  # its token is kept
    plan = s.schedule()
    assert plan.timed_out == [r] and r.timeout_kind == "token" and plan.chunks == []
    finish_all(s)


def test_total_timeout() -> None:
    s, clock = make()
    r = req(s, clock, 0, 4, timeouts=Timeouts(total=1.0))
    for _ in range(4):
        assert step(s, clock, dt=0.2).timed_out == []
    clock.now += 0.3
    assert s.schedule().timed_out == [r] and r.timeout_kind == "total"
    finish_all(s)


def test_the_scheduler_enforces_the_timeouts_the_door_settled() -> None:
    """A request's own limits tighten its class's once, at the door (tests/api/admission/test_door.py); the
    scheduler enforces what it is given, and does not tighten again."""
    strict = PriorityClass("interactive", 0, timeouts=Timeouts(queue=5.0, token=1.0))
    s, clock = make(classes=(strict, LO), max_num_seqs=1)
    given = Timeouts(queue=2.0, token=1.0)  # what the door made of Timeouts(queue=2.0)
    first = req(s, clock, 0, 4, strict)
    queued = req(s, clock, 1, 4, strict, timeouts=given)
    assert queued.timeouts is given and first.timeouts == Timeouts()  # nothing added to what it was given
    s.update(s.schedule(), {})
    clock.now += 2.5  # past the queue limit it was given, short of the class's 5 s
    assert s.schedule().timed_out == [queued] and queued.timeout_kind == "queue"
    finish_all(s)


def test_a_timed_out_preempted_request_frees_its_swap_space() -> None:
    s, clock = make(num_blocks=4, max_num_seqs=1, num_host_blocks=8, preemption_mode="swap")
    batch = req(s, clock, 0, 8, LO, timeouts=Timeouts(token=1.0))
    step(s, clock, dt=0.1)
    req(s, clock, 1, 4, HI)
    plan = step(s)  # the interactive request takes the only seat; batch goes to host memory
    assert plan.preempted == [batch] and batch.swapped
    assert s.block_manager.num_free_host_blocks == 5  # 8 computed tokens + the decode it lost
    clock.now += 2
    plan = s.schedule()
    assert batch in plan.timed_out and batch.timeout_kind == "token"
    assert s.block_manager.num_free_host_blocks == 8 and not s.block_manager.is_swapped(0)
    finish_all(s)


# ----------------------------------------------------------------------------- preemption


def test_no_priority_inversion_at_max_num_seqs() -> None:
    s, clock = make(max_num_seqs=3)
    batch = [req(s, clock, i, 4 + 4 * i, LO) for i in range(3)]  # computed: 4, 8, 12 tokens
    step(s)
    assert ids(s.running) == [0, 1, 2]
    clock.now += 1
    inter = req(s, clock, 9, 4, HI)
    plan = step(s)  # every seat taken by batch: the cheapest batch request gives its seat up
    assert plan.preempted == [batch[0]]
    assert inter.status == RequestStatus.RUNNING and 9 in scheduled(plan)
    assert batch[0].status == RequestStatus.WAITING and batch[0].num_computed_tokens == 0
    assert s.preemptions == {"recompute": 1} and s.stats["batch"].preemptions == {"recompute": 1}
    finish_all(s)


def test_a_waiting_request_never_preempts_its_own_class() -> None:
    s, clock = make(max_num_seqs=2)
    for i in range(2):
        req(s, clock, i, 4, HI)
    step(s)
    late = req(s, clock, 5, 4, HI)
    plan = step(s)
    assert plan.preempted == [] and late.status == RequestStatus.WAITING
    finish_all(s)


def test_victims_are_the_lowest_class_then_the_cheapest_to_resume() -> None:
    # 10 blocks of 4: standard (MID) 12 tokens, two batch requests 8 and 4 tokens: 6 blocks
    s, clock = make(num_blocks=10, classes=(HI, MID, LO))
    mid = req(s, clock, 0, 12, MID)
    big = req(s, clock, 1, 8, LO)
    small = req(s, clock, 2, 4, LO)
    step(s)
    assert s.block_manager.num_free_blocks == 4
    clock.now += 1
    inter = req(s, clock, 3, 12, HI)  # 3 blocks, 1 left after the decodes: one must give way
    plan = step(s)
    assert plan.preempted == [small]  # batch before standard; the cheaper batch one
    assert inter.status == RequestStatus.RUNNING
    clock.now += 1
    inter2 = req(s, clock, 4, 16, HI)
    plan = step(s)  # inter's decode needs a block: big goes; inter2 needs 4: then standard
    assert plan.preempted == [big, mid]
    assert inter2.status == RequestStatus.RUNNING
    finish_all(s)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_request_resumes_with_no_token_lost_or_repeated(mode: str) -> None:
    s, clock = make(num_blocks=6, max_num_seqs=2, num_host_blocks=16, preemption_mode=mode)
    batch = req(s, clock, 0, 8, LO, max_tokens=20)
    for _ in range(3):
        step(s)
    assert batch.output_ids == expected_outputs(batch) and len(batch.output_ids) == 3
    clock.now += 1
    inter = req(s, clock, 1, 16, HI, max_tokens=2)  # 4 blocks + growth: batch must go
    plan = step(s)
    assert plan.preempted == [batch]
    if mode == "swap":
        assert batch.swapped and batch.num_computed_tokens == 10 and len(plan.swap_out) == 3
        assert s.preemptions == {"swap": 1}
    else:
        assert not batch.swapped and batch.num_computed_tokens == 0
        assert s.preemptions == {"recompute": 1}
    s.finish(inter, RequestStatus.FINISHED_LENGTH)
    plan = step(s)  # room again: batch comes back
    assert batch.status == RequestStatus.RUNNING and 0 in scheduled(plan)
    if mode == "swap":
        assert len(plan.swap_in) == 3 and plan.decodes[0].start == 10  # straight to its next token
    else:
        # recompute: prompt + outputs again, reusing the two full prompt blocks still cached
        assert plan.prefills[0].start == 8 and plan.prefills[0].num_tokens == 3
    for _ in range(5):
        step(s)
    assert batch.output_ids == expected_outputs(batch) and len(batch.output_ids) == 9
    finish_all(s)


def test_a_resumed_request_is_not_preempted_again_before_it_makes_progress() -> None:
    # both batch requests resume into a pool that only just fits them; when one needs a block,
    # the victim is the one that already produced a token since resuming, not the newcomer
    s, clock = make(num_blocks=5, max_num_seqs=4)
    a = req(s, clock, 0, 8, LO)
    b = req(s, clock, 1, 7, LO)
    step(s)  # a: 2 blocks, b: 2 blocks (7 of 8 slots)
    step(s)  # a writes position 8 into a new block (the last free one); b fills its block
    assert s.block_manager.num_free_blocks == 0
    b.num_preemptions, b.progress_mark = 1, len(b.output_ids)  # as if b had just been resumed
    plan = s.schedule()  # b needs a block for position 8; b is cheaper but has not progressed
    assert plan.preempted == [a]
    s.update(plan, fabricate(plan))
    finish_all(s)


def test_preemption_under_pressure_loses_nothing_in_either_mode() -> None:
    for mode in ("recompute", "swap"):
        s, clock = make(num_blocks=20, max_num_seqs=6, budget=16, num_host_blocks=12, preemption_mode=mode)
        reqs = [req(s, clock, i, 3 + (i * 7) % 10, (HI, LO)[i % 2], max_tokens=4 + (i * 5) % 17)
                for i in range(24)]
        for _ in range(3000):
            if not s.has_work():
                break
            plan = step(s, clock, dt=0.01)
            s.block_manager.check_invariants()
            for c in plan.chunks:
                r = c.request
                if r.status == RequestStatus.RUNNING and r.num_tokens >= r.max_total_tokens:
                    s.finish(r, RequestStatus.FINISHED_LENGTH)
        assert not s.has_work()
        assert s.num_preemptions > 0, mode
        for r in reqs:
            assert r.output_ids == [10_000 * (r.seq_id + 1) + i for i in range(r.params.max_tokens)]
        finish_all(s)


# ---------------------------------------------------------------------------- KV headroom


def test_a_class_cannot_use_its_kv_reserve() -> None:
    reserving = PriorityClass("batch", 1, kv_reserve=0.5, sheddable=True)
    s, clock = make(num_blocks=8, classes=(HI, reserving))
    b1 = req(s, clock, 0, 12, reserving)  # 3 blocks, and 1 to grow into: then only the reserve is left
    b2 = req(s, clock, 1, 8, reserving)  # would dig into the reserve: waits
    step(s)
    assert b1.status == RequestStatus.RUNNING and b2.status == RequestStatus.WAITING
    inter = req(s, clock, 2, 16, HI)  # the reserve is for it
    plan = step(s)
    assert inter.status == RequestStatus.RUNNING and plan.preempted == []
    finish_all(s)


# ------------------------------------------------------------------------------ shedding


def test_shedding_level_two_caps_running_batch_work_and_level_three_its_max_tokens() -> None:
    shed = ShedConfig(margin=0.0, window_seconds=10.0, min_samples=1, escalate_seconds=1.0,
                      recover_seconds=5.0, max_running=1, max_tokens=3)
    s, clock = make(max_num_seqs=8, shedding=shed)
    batch = [req(s, clock, i, 4, LO, max_tokens=50) for i in range(3)]
    step(s)
    inter = req(s, clock, 9, 4, HI)
    clock.now += 2.0  # its TTFT will be 2 s against a 1 s target
    step(s)
    assert inter.output_ids and s.shedder.level == 0  # the sample is taken at this update
    levels = []
    for _ in range(3):
        clock.now += 1.1
        plan = step(s)
        levels.append(s.shedder.level)
    assert levels == [1, 2, 3]
    running_batch = [r for r in s.running if r.priority_class is LO]
    assert len(running_batch) == 1  # level 2: the other two were preempted
    assert all(r.token_cap == 3 for r in batch)  # level 3: max_tokens lowered
    assert running_batch[0].max_total_tokens == 4 + 3
    # clear for long enough: it steps down one level per recover period
    s.finish(inter, RequestStatus.FINISHED_STOPPED)
    clock.now += 11  # the slow sample has left the window, and it has been clear for 5 s
    step(s)
    assert s.shedder.level == 2
    assert all(r.token_cap is None for r in batch)  # below level 3: the cap is lifted
    clock.now += 4.9
    step(s)
    assert s.shedder.level == 2  # each step down needs a whole clear period
    clock.now += 0.2
    step(s)
    assert s.shedder.level == 1
    finish_all(s)


# --------------------------------------------------------------------------- prefix cache


def test_a_shared_prefix_is_computed_once() -> None:
    s, clock = make(num_blocks=32)
    system = list(range(500, 516))  # 4 full blocks
    a = req(s, clock, 0, 0, prompt=system + [1, 2, 3])
    step(s)
    b = req(s, clock, 1, 0, prompt=system + [7, 8])
    plan = step(s)
    chunk = next(c for c in plan.prefills if c.request is b)
    assert (chunk.start, chunk.num_tokens) == (16, 2)  # only the suffix
    assert b.num_cached_tokens == 16 and a.num_cached_tokens == 0
    assert s.stats["interactive"].cached_prompt_tokens == 16
    assert s.block_manager.block_table(0)[:4] == s.block_manager.block_table(1)[:4]
    finish_all(s)
    assert s.block_manager.num_cached_blocks >= 4  # kept after both finished, evictable


# ------------------------------------------------------------------------------ randomized


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(["recompute", "swap"]),
    num_blocks=st.integers(8, 30),
    host_blocks=st.integers(0, 12),
    seats=st.integers(1, 6),
    budget=st.integers(4, 24),
    # (arrival step, prompt length, max_tokens, batch?, per-token timeout, aborted after 2 tokens?)
    arrivals=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 14), st.integers(1, 12), st.booleans(),
                                st.sampled_from([None, 0.3, 2.0]), st.booleans()),
                      min_size=1, max_size=24),
)
def test_random_workloads_keep_every_invariant(mode, num_blocks, host_blocks, seats, budget, arrivals) -> None:
    """Whatever arrives (classes, prompt and output lengths, token timeouts, aborts), in either
    preemption mode: the pool stays consistent, every request ends, each output is exactly the
    tokens it sampled in order, and nothing is held at the end."""
    s, clock = make(num_blocks=num_blocks, max_num_seqs=seats, budget=budget, num_host_blocks=host_blocks,
                    preemption_mode=mode, aging_seconds=1.0)
    capacity = num_blocks * 4
    arrivals = sorted(arrivals, key=lambda a: a[0])
    reqs: list[Request] = []
    aborted: set[int] = set()
    for t in range(5000):
        while arrivals and arrivals[0][0] <= t:
            at, prompt_len, max_tokens, batch, token_timeout, abort = arrivals.pop(0)
            r = req(s, clock, len(reqs), prompt_len, LO if batch else HI,
                    max_tokens=min(max_tokens, capacity - prompt_len), timeouts=Timeouts(token=token_timeout))
            reqs.append(r)
            if abort:
                aborted.add(r.seq_id)
        if not arrivals and not s.has_work():
            break
        for r in reqs:
            if r.seq_id in aborted and len(r.output_ids) == 2:
                s.finish(r, RequestStatus.FINISHED_ABORTED)
        plan = step(s, clock, dt=0.05)
        s.block_manager.check_invariants()
        assert len(s.running) <= seats
        for c in plan.chunks:
            r = c.request
            if r.status == RequestStatus.RUNNING and r.num_tokens >= r.max_total_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert not s.has_work()
    for r in reqs:
        assert r.status.finished, r
        assert r.output_ids == expected_outputs(r)  # no token lost or repeated, in order
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert len(r.output_ids) == r.params.max_tokens
    finish_all(s)
    assert s.block_manager.num_free_host_blocks == host_blocks
