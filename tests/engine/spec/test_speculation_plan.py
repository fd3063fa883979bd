"""The scheduler's and the block manager's side of speculation, without a model: room for the
drafts, the budget they may take, and the room of rejected drafts given back whole."""

from __future__ import annotations

from inferd.engine.kv.block_manager import BlockManager
from inferd.engine.sched.request import Request, RequestStatus
from inferd.engine.sched.scheduler import Scheduler
from inferd.settings.policy import SchedulingPolicy
from inferd.text.sampling_params import SamplingParams

POLICY = SchedulingPolicy()


def decoding(s: Scheduler, prompts: list[int]) -> list[Request]:
    """Requests (of these prompt lengths) whose prompts are computed and first tokens sampled."""
    reqs = [Request(i, list(range(100, 100 + n)), SamplingParams(max_tokens=100), 4096,
                    priority_class=POLICY.lookup(None)) for i, n in enumerate(prompts)]
    for req in reqs:
        s.add(req)
    plan = s.schedule()
    s.update(plan, {r.seq_id: 7 for r in reqs})
    assert all(r.status == RequestStatus.RUNNING and r.num_tokens - r.num_computed_tokens == 1 for r in reqs)
    return reqs


def test_a_decode_takes_its_drafts_and_gives_back_the_rejected_ones_room() -> None:
    bm = BlockManager(64, 4)
    s = Scheduler(bm, 8, 512, POLICY)
    (req,) = decoding(s, [30])  # 30 prompt tokens + 1: 8 blocks of 4
    req.draft_ids = [11, 12, 13, 14, 15, 16, 17]
    plan = s.schedule()
    (chunk,) = plan.decodes
    assert chunk.drafts == [11, 12, 13, 14, 15, 16, 17] and chunk.num_tokens == 8 and chunk.samples
    assert plan.num_tokens == 8
    assert bm.num_tokens(0) == 38 and len(bm.block_table(0)) == 10
    s.update(plan, {0: 99}, {0: [11, 12]})  # two accepted, then its own token
    assert req.output_ids == [7, 11, 12, 99]
    assert req.num_computed_tokens == 33 and bm.num_tokens(0) == 33 and len(bm.block_table(0)) == 9
    bm.check_invariants()
    # the blocks full of accepted tokens are cached; nothing past them
    assert len(bm._keys[0]) == 8
    s.finish(req, RequestStatus.FINISHED_STOPPED)
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_drafts_take_only_what_the_budget_leaves_after_every_decode() -> None:
    bm = BlockManager(256, 16)
    s = Scheduler(bm, 8, 10, POLICY)
    reqs = decoding(s, [2, 2, 2, 2])
    for r in reqs:
        r.draft_ids = [1, 2, 3, 4]
    plan = s.schedule()
    assert sorted(len(c.drafts) for c in plan.decodes) == [0, 0, 2, 4]  # 10 tokens: 4 decodes, 6 drafts
    assert plan.num_tokens == 10
    s.update(plan, {r.seq_id: 5 for r in reqs})  # every draft rejected
    assert all(bm.num_tokens(r.seq_id) == r.num_computed_tokens for r in reqs)
    bm.check_invariants()


def test_short_of_blocks_a_decode_drops_its_drafts_rather_than_preempt() -> None:
    bm = BlockManager(9, 4)
    s = Scheduler(bm, 8, 512, POLICY)
    a, b = decoding(s, [15, 15])  # 16 tokens each: 4 blocks
    a.draft_ids = list(range(20))  # would need 5 more blocks; one is free
    plan = s.schedule()
    assert [c.num_tokens for c in plan.decodes] == [1, 1] and not plan.preempted
    s.update(plan, {0: 3, 1: 3})
    assert b.status == RequestStatus.RUNNING
    bm.check_invariants()


def test_truncate_gives_back_a_sliding_groups_room_too() -> None:
    bm = BlockManager(32, 4, windows=(None, 4))
    assert bm.allocate(1, 10) == 0
    bm.commit(1, 9, lambda a, b: list(range(a, b)))  # the window's earlier blocks go back
    assert bm.append(1, 9) == []
    bm.truncate(1, 11)
    assert bm.num_tokens(1) == 11 and all(len(t) == 3 for t in bm.block_tables(1))
    bm.check_invariants()
    bm.free(1)
    assert bm.num_used_blocks == 0
