"""State slots beside the block pool (a hybrid model's linear layers): working slots, checkpoints
filed under the blocks' keys, hits cut back to a checkpoint, branch points, decode checkpoints,
fork and swap, all through the BlockManager as the scheduler drives it."""

from __future__ import annotations

import pytest

from inferd.engine.kv.block_manager import BlockError, BlockManager
from inferd.engine.kv.state_slots import DECODE_CHECKPOINTS, StateSlots

BS = 4


def manager(num_slots: int = 16, num_blocks: int = 64, host_slots: int = 0, host_blocks: int = 0,
            max_live: int = 4, prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BS, num_host_blocks=host_blocks, enable_prefix_caching=prefix_caching,
                        state=StateSlots(num_slots, host_slots, max_live))


def run_prompt(bm: BlockManager, seq: int, tokens: list[int], chunk: int = 1000) -> list[list[tuple[int, int]]]:
    """Allocate and 'compute' a prompt in chunks as the scheduler does; each chunk's saves."""
    start = bm.allocate(seq, min(len(tokens), chunk), tokens)
    assert start is not None
    all_saves = []
    while start < len(tokens):
        n = min(chunk, len(tokens) - start)
        if bm.num_tokens(seq) < start + n:
            assert bm.append(seq, start + n - bm.num_tokens(seq)) is not None
        saves = bm.state.plan_saves(seq, start, start + n, BS, decode=False)
        all_saves.append(saves)
        start += n
        bm.commit(seq, start, lambda a, b: tokens[a:b])
    bm.check_invariants()
    return all_saves


def decode(bm: BlockManager, seq: int, tokens: list[int], new: list[int]) -> None:
    """Decode `new` tokens after `tokens` (each computed the step after it is sampled)."""
    for t in new:
        computed = len(tokens)
        tokens.append(t)
        assert bm.append(seq, 1) is not None
        bm.state.plan_saves(seq, computed, computed + 1, BS, decode=True)
        bm.commit(seq, computed + 1, lambda a, b: tokens[a:b])
    bm.check_invariants()


def test_a_prompt_leaves_a_checkpoint_at_the_last_block_end_of_each_chunk() -> None:
    bm = manager()
    tokens = list(range(1, 23))  # 22 tokens: block ends 4, 8, 12, 16, 20
    saves = run_prompt(bm, 1, tokens, chunk=10)  # chunks [0, 10), [10, 20), [20, 22)
    assert [[end for end, _ in s] for s in saves] == [[8], [20], []]
    assert bm.state is not None and bm.state.num_checkpoints == 2
    bm.free(1)
    bm.check_invariants()
    # a second turn that extends the prompt resumes from the deepest checkpoint (20 tokens)
    ops_before = len(bm.state.ops)
    assert bm.cached_prefix(tokens + [99, 98]) == 20
    assert bm.allocate(2, 24, tokens + [99, 98]) == 20
    assert bm.state.ops[ops_before:] == [("copy", bm.state.checkpoint(bm._keys[2][-1]), bm.state.slot(2))]
    assert bm.state.stats.checkpoint_hits == 1 and bm.state.stats.checkpoint_hit_tokens == 20
    bm.check_invariants()


def test_a_hit_is_cut_back_to_the_deepest_checkpoint_and_the_branch_point_is_saved() -> None:
    bm = manager()
    shared = list(range(1, 17))  # 16 tokens: 4 blocks
    run_prompt(bm, 1, shared + [50, 51, 52, 53, 54], chunk=100)  # one chunk: checkpoint at 20 only
    bm.free(1)
    # a prompt that shares 16 tokens: the attention blocks hit 4 blocks, no checkpoint inside them
    other = shared + [60, 61, 62, 63, 64, 65]
    assert bm.cached_prefix(other) == 0
    saves = run_prompt(bm, 2, other, chunk=100)
    assert [end for end, _ in saves[0]] == [16, 20]  # the branch point and the chunk's last block end
    bm.free(2)
    # the third prompt sharing those 16 tokens resumes at the branch point
    assert bm.cached_prefix(shared + [70, 71, 72, 73, 74]) == 16


def test_decode_keeps_only_the_last_checkpoints_of_a_sequence() -> None:
    bm = manager()
    tokens = list(range(1, 7))
    run_prompt(bm, 1, tokens)  # checkpoint at 4
    assert bm.state is not None
    decode(bm, 1, tokens, list(range(100, 120)))  # block ends 8, 12, 16, 20, 24 computed by decode rows
    # the prompt's checkpoint and the last two decode ones
    assert bm.state.num_checkpoints == 1 + DECODE_CHECKPOINTS
    bm.free(1)
    # a next turn that re-tokenizes the answer's last block differently resumes a block before
    turn = tokens[:22] + [7, 7, 7, 7]
    assert bm.cached_prefix(turn) == 20
    assert bm.cached_prefix(tokens[:25] + [9]) == 24


def test_no_checkpoints_without_prefix_caching() -> None:
    bm = manager(prefix_caching=False)  # (the scheduler plans no saves then; had it, none is filed)
    saves = run_prompt(bm, 1, list(range(1, 30)), chunk=8)
    assert any(saves)
    assert bm.state is not None and bm.state.num_checkpoints == 0 and bm.cached_prefix(list(range(1, 40))) == 0


def test_checkpoints_are_evicted_least_recently_used_and_never_block_a_sequence() -> None:
    bm = manager(num_slots=4, max_live=2)  # 2 working seats, 1 spare, 1 more
    assert bm.state is not None
    run_prompt(bm, 1, list(range(1, 10)), chunk=4)
    bm.free(1)
    run_prompt(bm, 2, list(range(20, 30)), chunk=4)
    bm.free(2)
    assert bm.state.num_checkpoints <= 4
    # two sequences start, whatever the checkpoints held
    assert bm.allocate(3, 5, list(range(40, 45))) == 0
    assert bm.allocate(4, 5, list(range(50, 55))) == 0
    assert bm.state.stats.evictions >= 1
    bm.check_invariants()


def test_a_save_never_takes_the_slot_a_new_sequence_needs() -> None:
    bm = manager(num_slots=2, max_live=2)
    assert bm.allocate(1, 5, list(range(1, 6))) == 0
    assert bm.state.plan_saves(1, 0, 5, BS, decode=False) == []  # the one slot left is the other seat's
    assert bm.allocate(2, 5, list(range(6, 11))) == 0
    bm = manager(num_slots=3, max_live=2)
    assert bm.allocate(1, 5, list(range(1, 6))) == 0
    assert [end for end, _ in bm.state.plan_saves(1, 0, 5, BS, decode=False)] == [4]  # the spare
    assert bm.allocate(2, 5, list(range(6, 11))) == 0
    bm.check_invariants()


def test_a_sequence_needs_a_slot() -> None:
    bm = manager(num_slots=1, max_live=1)
    assert bm.allocate(1, 3, [1, 2, 3]) == 0
    assert not bm.can_allocate(3, [4, 5, 6])
    assert bm.allocate(2, 3, [4, 5, 6]) is None
    bm.free(1)
    assert bm.allocate(2, 3, [4, 5, 6]) == 0
    bm.check_invariants()


def test_fork_copies_the_parent_state_and_swap_moves_it_through_a_host_slot() -> None:
    bm = manager(host_slots=2, host_blocks=16)
    state = bm.state
    assert state is not None
    run_prompt(bm, 1, [1, 2, 3, 4, 5])
    state.take_ops()
    bm.fork(1, 2)
    assert state.take_ops() == [("copy", state.slot(1), state.slot(2))]
    working = state.slot(2)
    assert bm.swap_out(2) is not None
    assert state.take_ops() == [("out", working, 0)]
    bm.check_invariants()
    assert bm.swap_in(2) is not None
    assert state.take_ops() == [("in", 0, state.slot(2))]
    bm.check_invariants()
    bm.free(1)
    bm.free(2)
    bm.check_invariants()


def test_swap_out_needs_a_host_slot() -> None:
    bm = manager(host_slots=0, host_blocks=16)
    run_prompt(bm, 1, [1, 2, 3])
    assert not bm.can_swap_out(1) and bm.swap_out(1) is None


def test_pending_saves_of_a_taken_back_chunk_are_returned() -> None:
    bm = manager()
    tokens = list(range(1, 12))
    assert bm.allocate(1, 11, tokens) == 0
    saves = bm.state.plan_saves(1, 0, 11, BS, decode=False)
    assert saves
    bm.free(1)  # preempted before its step ran
    bm.check_invariants()
    with pytest.raises(BlockError):
        bm.state.plan_saves(1, 0, 1, BS, decode=True)
