"""The scheduler fed fabricated model outputs (vLLM's style): no torch, no model.

Each test builds `Request`s and a tiny `BlockManager`, calls `schedule()`, makes up the sampled
tokens itself (`fake_token`, distinct per request and position) and calls `update()`, then
asserts exactly what was scheduled, admitted, preempted, forked and freed.
"""

from __future__ import annotations

import random

import pytest

from inferd.engine.kv.block_manager import BlockManager
from inferd.engine.protocol import PoolingParams
from inferd.engine.sched.request import Request, RequestStatus
from inferd.engine.sched.scheduler import Scheduler, SchedulerOutput
from inferd.text.sampling_params import SamplingParams
from inferd.settings.policy import SchedulingPolicy

MAX_MODEL_LEN = 1024
DEFAULT_CLASS = SchedulingPolicy().lookup(None)  # the class of every request here


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens)


def make_request(seq_id: int, prompt_len: int, max_tokens: int = 16, n: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = [seq_id * 100 + i for i in range(prompt_len)]
    req = Request(seq_id, prompt, params, MAX_MODEL_LEN, priority_class=DEFAULT_CLASS)
    # choices 1..n-1 take the ids right after the root's, as LLMEngine.add_request does
    req.forks = [Request(seq_id + i, prompt, params, MAX_MODEL_LEN, index=i, group_id=seq_id)
                 for i in range(1, n)]
    return req


def fake_token(req: Request) -> int:
    """The made-up token a request samples next: distinct per request and output position."""
    return 10_000 * (req.seq_id + 1) + len(req.output_ids)


def fabricate(plan: SchedulerOutput) -> dict[int, int]:
    """What the runner would return: one token per sampling chunk, plus one per pending fork."""
    sampled = {}
    for chunk in plan.chunks:
        if chunk.samples:
            for req in (chunk.request, *chunk.request.forks_pending):
                sampled[req.seq_id] = fake_token(req)
    return sampled


def step(scheduler: Scheduler) -> SchedulerOutput:
    plan = scheduler.schedule()
    scheduler.update(plan, fabricate(plan))
    return plan


def layout(chunks: list) -> list[tuple[int, int, int]]:
    """(request id, start, num_tokens) of each chunk, in order."""
    return [(c.request.seq_id, c.start, c.num_tokens) for c in chunks]


def ids(requests) -> list[int]:
    return [r.seq_id for r in requests]


def assert_pool_whole(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.pool.num_blocks
    assert not scheduler.running and not scheduler.waiting and not bm._tables


# ---- admission ----

def test_admission_is_first_come_first_served() -> None:
    s = make_scheduler()
    reqs = [make_request(i, prompt_len=3 + i) for i in range(3)]
    for r in reqs:
        s.add(r)
    plan = step(s)
    assert layout(plan.prefills) == [(0, 0, 3), (1, 0, 4), (2, 0, 5)]
    assert plan.decodes == [] and plan.preempted == [] and plan.block_copies == []
    assert ids(s.running) == [0, 1, 2] and not s.waiting
    assert all(r.status == RequestStatus.RUNNING for r in reqs)
    assert [r.output_ids for r in reqs] == [[10_000], [20_000], [30_000]]
    assert [r.num_computed_tokens for r in reqs] == [3, 4, 5]

    plan = step(s)  # now all decode, oldest first
    assert plan.prefills == []
    assert layout(plan.decodes) == [(0, 3, 1), (1, 4, 1), (2, 5, 1)]
    assert [r.output_ids for r in reqs] == [[10_000, 10_001], [20_000, 20_001], [30_000, 30_001]]
    for r in reqs:
        s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert_pool_whole(s)


def test_a_blocked_head_of_queue_is_not_overtaken() -> None:
    # 4 blocks of 4: request 0 takes 2, request 1 needs 3 and waits; request 2 (1 block) would
    # fit but must not jump the queue
    s = make_scheduler(num_blocks=4)
    r0, r1, r2 = make_request(0, 8), make_request(1, 12), make_request(2, 2)
    for r in (r0, r1, r2):
        s.add(r)
    plan = step(s)
    assert layout(plan.prefills) == [(0, 0, 8)]
    assert ids(s.waiting) == [1, 2]
    s.finish(r0, RequestStatus.FINISHED_STOPPED)
    plan = step(s)  # the head first, then request 2 in the block left over
    assert layout(plan.prefills) == [(1, 0, 12), (2, 0, 2)]
    for r in (r1, r2):
        s.finish(r, RequestStatus.FINISHED_STOPPED)
    assert_pool_whole(s)


def test_max_num_seqs_caps_the_running_set() -> None:
    s = make_scheduler(max_num_seqs=2)
    reqs = [make_request(i, 4) for i in range(3)]
    for r in reqs:
        s.add(r)
    plan = step(s)
    assert ids(c.request for c in plan.chunks) == [0, 1]
    assert ids(s.running) == [0, 1] and ids(s.waiting) == [2]
    plan = step(s)
    assert layout(plan.decodes) == [(0, 4, 1), (1, 4, 1)] and plan.prefills == []
    s.finish(reqs[0], RequestStatus.FINISHED_STOPPED)
    plan = step(s)  # a freed seat goes to the next in line, in the same step as the decodes
    assert layout(plan.decodes) == [(1, 5, 1)]
    assert layout(plan.prefills) == [(2, 0, 4)]
    assert ids(s.running) == [1, 2]
    for r in reqs[1:]:
        s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert_pool_whole(s)


def test_forks_count_against_max_num_seqs() -> None:
    s = make_scheduler(max_num_seqs=3)
    s.add(make_request(0, 4))
    group = make_request(1, 4, n=3)  # choices 1, 2, 3: three sequences once forked
    s.add(group)
    plan = step(s)
    assert ids(c.request for c in plan.chunks) == [0]  # 1 + 3 > 3: the group waits
    assert ids(s.waiting) == [1]
    s.finish(s.running[0], RequestStatus.FINISHED_LENGTH)
    plan = step(s)
    assert layout(plan.prefills) == [(1, 0, 4)]
    assert ids(s.running) == [1, 2, 3]
    for r in list(s.running):
        s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert_pool_whole(s)


# ---- chunked prefill ----

def test_long_prompt_is_chunked_by_the_token_budget_alongside_decodes() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    short = make_request(0, 3)
    s.add(short)
    step(s)  # short is decoding from now on
    long = make_request(1, 20)
    s.add(long)

    # budget 8 per step: 1 decode token + 7 prompt tokens, until the prompt's last 6
    expected = [(1, 0, 7), (1, 7, 7), (1, 14, 6)]
    for k, chunk in enumerate(expected):
        plan = s.schedule()
        assert layout(plan.decodes) == [(0, 3 + k, 1)]
        assert layout(plan.prefills) == [chunk]
        last = k == len(expected) - 1
        assert plan.prefills[0].samples == last  # (asked before update: it reads live counts)
        s.update(plan, fabricate(plan))
        assert long.output_ids == ([20_000] if last else [])  # no token from a partial prompt
        assert long.num_computed_tokens == chunk[1] + chunk[2]
        assert plan.num_tokens == 1 + chunk[2]
    assert s.block_manager.num_tokens(1) == 20
    assert s.block_manager.block_table(1) == plan.prefills[0].block_table
    assert len(plan.prefills[0].block_table) == 5

    plan = step(s)
    assert layout(plan.decodes) == [(0, 6, 1), (1, 20, 1)] and plan.prefills == []
    assert short.output_ids == [10_000 + i for i in range(5)]
    assert long.output_ids == [20_000, 20_001]
    for r in (short, long):
        s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert_pool_whole(s)


def test_running_requests_use_the_budget_before_admission() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    a, b = make_request(0, 10), make_request(1, 4)
    s.add(a)
    s.add(b)
    plan = step(s)
    assert layout(plan.prefills) == [(0, 0, 8)]  # the whole budget: b waits
    assert ids(s.waiting) == [1]
    plan = step(s)
    assert layout(plan.prefills) == [(0, 8, 2), (1, 0, 4)]
    assert a.output_ids == [10_000] and b.output_ids == [20_000]
    for r in (a, b):
        s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert_pool_whole(s)


# ---- preemption ----

def test_preemption_hits_the_newest_and_requeues_it_first() -> None:
    # 6 blocks of 4 tokens, three 8-token prompts: only two fit; the third waits behind them
    s = make_scheduler(num_blocks=6, max_num_seqs=2)
    r0, r1, r2 = make_request(0, 8), make_request(1, 8), make_request(2, 8)
    for r in (r0, r1, r2):
        s.add(r)
    step(s)  # prefill r0, r1: 4 blocks
    assert ids(s.running) == [0, 1] and ids(s.waiting) == [2]
    for _ in range(4):  # tokens 9..12: one more block each, the pool is then full
        plan = step(s)
        assert plan.preempted == []
    assert s.block_manager.num_free_blocks == 0
    assert r1.num_tokens == 13 and r1.num_computed_tokens == 12

    r1_blocks = list(s.block_manager.block_table(1))
    plan = step(s)  # r0's 13th token needs a block: r1, the newest, gives its 3 back
    assert plan.preempted == [r1]
    assert layout(plan.decodes) == [(0, 12, 1)] and plan.prefills == []
    assert ids(s.running) == [0] and ids(s.waiting) == [1, 2]  # at the front, before r2
    assert r1.status == RequestStatus.WAITING and r1.num_computed_tokens == 0
    assert r1.num_preemptions == 1 and s.num_preemptions == 1
    assert 1 not in s.block_manager._tables
    assert s.block_manager.block_table(0)[-1] == r1_blocks[-1]  # r0 got r1's tail block (FIFO)
    assert s.block_manager.num_free_blocks == 2  # r1 needs 4 blocks for 13 tokens: it waits
    s.block_manager.check_invariants()

    s.finish(r0, RequestStatus.FINISHED_STOPPED)
    plan = s.schedule()  # r1 recomputes its 5 outputs (its prompt's blocks are still cached); then r2
    assert layout(plan.prefills) == [(1, 8, 5), (2, 0, 8)] and plan.prefills[0].samples
    s.update(plan, fabricate(plan))
    assert ids(s.running) == [1, 2] and not s.waiting
    assert r1.output_ids == [20_000 + i for i in range(6)]  # no token lost or sampled twice
    s.finish(r1, RequestStatus.FINISHED_LENGTH)
    s.finish(r2, RequestStatus.FINISHED_ABORTED)
    assert_pool_whole(s)


def test_a_request_that_cannot_grow_and_is_newest_preempts_itself() -> None:
    # r0 has room in its last block, r1 (the newest) needs a new block and none is free
    s = make_scheduler(num_blocks=3)
    r0, r1 = make_request(0, 6), make_request(1, 4)
    s.add(r0)
    s.add(r1)
    step(s)  # r0: 2 blocks (6 of 8 slots), r1: 1 full block; the pool is full
    assert s.block_manager.num_free_blocks == 0
    plan = s.schedule()
    assert plan.preempted == [r1]
    assert layout(plan.decodes) == [(0, 6, 1)] and plan.prefills == []
    assert ids(s.running) == [0] and ids(s.waiting) == [1]
    s.update(plan, fabricate(plan))
    assert r1.output_ids == [20_000] and r0.output_ids == [10_000, 10_001]
    for r in (r0, r1):
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert_pool_whole(s)


def test_no_block_leaks_under_memory_pressure() -> None:
    # many requests through a pool far too small for all of them at once
    rng = random.Random(0)
    s = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=16)
    reqs = [make_request(i, rng.randint(1, 12), max_tokens=rng.randint(1, 20)) for i in range(30)]
    for r in reqs:
        s.add(r)
    for _ in range(2000):
        if not s.has_work():
            break
        plan = step(s)
        s.block_manager.check_invariants()
        for chunk in plan.chunks:
            r = chunk.request
            if r.status == RequestStatus.RUNNING and r.num_tokens >= r.max_total_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert s.num_preemptions > 0
    for r in reqs:  # outputs survive preemption: each token was sampled exactly once, in order
        assert r.output_ids == [10_000 * (r.seq_id + 1) + i for i in range(r.params.max_tokens)]
    assert_pool_whole(s)


# ---- n > 1 ----

def test_forks_share_the_prompt_blocks_then_copy_on_write() -> None:
    s = make_scheduler()
    root = make_request(0, 6, n=3)
    f1, f2 = root.forks
    s.add(root)
    bm = s.block_manager

    plan = step(s)
    assert layout(plan.prefills) == [(0, 0, 6)]
    assert ids(s.running) == [0, 1, 2]
    for r in (f1, f2):
        assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 6
    assert root.output_ids == [10_000] and f1.output_ids == [20_000] and f2.output_ids == [30_000]
    assert bm.block_table(0) == bm.block_table(1) == bm.block_table(2) == [0, 1]
    assert [bm.pool.refcount(b) for b in (0, 1)] == [3, 3]
    assert root.forks_pending == []

    # each writes position 6 into the shared, partly filled block 1: the first two get copies,
    # the last one is its sole owner by then and writes in place
    plan = step(s)
    assert layout(plan.decodes) == [(0, 6, 1), (1, 6, 1), (2, 6, 1)]
    assert plan.block_copies == [(1, 2), (1, 3)]
    assert bm.block_table(0) == [0, 2] and bm.block_table(1) == [0, 3] and bm.block_table(2) == [0, 1]
    assert [bm.pool.refcount(b) for b in range(4)] == [3, 1, 1, 1]
    assert f2.output_ids == [30_000, 30_001]

    plan = step(s)  # nothing shared in the last blocks any more
    assert plan.block_copies == []
    for r in (root, f1, f2):
        s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert_pool_whole(s)


def test_fork_of_a_chunked_prompt_happens_at_the_first_token_only() -> None:
    s = make_scheduler(max_num_batched_tokens=4)
    root = make_request(0, 6, n=2)
    [fork] = root.forks
    s.add(root)
    plan = s.schedule()
    assert layout(plan.prefills) == [(0, 0, 4)] and not plan.prefills[0].samples
    s.update(plan, fabricate(plan))
    assert ids(s.running) == [0] and fork.status == RequestStatus.WAITING
    plan = step(s)
    assert layout(plan.prefills) == [(0, 4, 2)]
    assert ids(s.running) == [0, 1] and fork.output_ids == [20_000]
    assert s.block_manager.block_table(1) == s.block_manager.block_table(0)
    for r in (root, fork):
        s.finish(r, RequestStatus.FINISHED_STOPPED)
    assert_pool_whole(s)


# ---- finish and abort ----

def test_finish_frees_blocks_at_once() -> None:
    s = make_scheduler(num_blocks=8)
    r = make_request(0, 10)
    s.add(r)
    step(s)
    assert s.block_manager.num_free_blocks == 5
    s.finish(r, RequestStatus.FINISHED_STOPPED)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.status.finish_reason == "stop"
    assert not s.running and s.block_manager.num_free_blocks == 8
    assert s.schedule().chunks == []
    assert_pool_whole(s)


@pytest.mark.parametrize("first", [RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH])
def test_an_abort_racing_a_finish_frees_nothing_twice(first: RequestStatus) -> None:
    s = make_scheduler(num_blocks=8)
    r, other = make_request(0, 5), make_request(1, 5)
    s.add(r)
    s.add(other)
    step(s)
    s.finish(r, first)
    s.finish(r, RequestStatus.FINISHED_ABORTED)  # arrives late: ignored, no double free
    assert r.status == first
    s.block_manager.check_invariants()
    assert ids(s.running) == [1] and s.block_manager.num_free_blocks == 6
    s.finish(other, RequestStatus.FINISHED_ABORTED)
    assert_pool_whole(s)


def test_abort_of_a_waiting_or_preempted_request() -> None:
    s = make_scheduler(num_blocks=2, max_num_seqs=1)
    a, b = make_request(0, 8), make_request(1, 4)
    s.add(a)
    s.add(b)
    step(s)
    s.finish(b, RequestStatus.FINISHED_ABORTED)  # never admitted: leaves the queue
    assert not s.waiting and b.status == RequestStatus.FINISHED_ABORTED
    plan = step(s)  # a's 10th token needs a third block: a preempts itself and waits
    assert plan.preempted == [a] and ids(s.waiting) == [0]
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert_pool_whole(s)


def test_abort_of_a_group_before_its_forks_start() -> None:
    s = make_scheduler()
    root = make_request(0, 6, n=3)
    s.add(root)
    for r in (root, *root.forks):  # the engine aborts every member; the forks hold nothing
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in (root, *root.forks))
    assert_pool_whole(s)


def pooling_request(seq_id: int, prompt_len: int) -> Request:
    req = make_request(seq_id, prompt_len, max_tokens=1)
    req.pooling, req.priority_class = PoolingParams(), SchedulingPolicy().lookup("batch")  # (the pooling class)
    return req


def test_pooling_prompts_take_a_capped_share_of_a_step_and_none_beside_a_generation_prompt() -> None:
    """[scheduler] pooling_step_tokens: embeddings' prompts take at most that many tokens a step
    (in chunks, across requests), and none in a step that computes a generation's prompt."""
    sched = make_scheduler(max_num_batched_tokens=64)
    cap = sched.policy.pooling_step_tokens
    docs = [pooling_request(i, 10) for i in (1, 2, 3)]
    for req in docs:
        sched.add(req)
    plan = sched.schedule()
    assert 0 < plan.num_prefill_tokens <= cap
    sched.update(plan, fabricate(plan))
    chat = make_request(10, 20)
    sched.add(chat)
    plan = sched.schedule()
    assert [c.request for c in plan.prefills] == [chat] and plan.num_prefill_tokens == 20
    sched.update(plan, fabricate(plan))
    plan = sched.schedule()  # the chat decodes: the pooling share is back
    assert any(c.request.pooling is not None for c in plan.prefills)
    assert sum(c.num_tokens for c in plan.prefills) <= cap
