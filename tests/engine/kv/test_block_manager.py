"""BlockPool / PrefixCache / BlockManager: unit tests, then a hypothesis state machine against a
shadow model.

The state machine also keeps a fake KV cache (one int per slot) and a fake host cache. A slot holds
an id of the whole prefix up to its position, which is what a real KV entry depends on: every
sequence must read back exactly its own prefixes, whether computed, reused from the prefix cache,
copied on write or swapped out and in. Tokens are written only into blocks no one else holds.
That catches sharing bugs the refcount checks alone would miss.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inferd.engine.kv.block_manager import BlockError, BlockManager
from inferd.engine.kv.block_pool import BlockPool
from inferd.engine.kv.prefix_cache import block_key


def snapshot(bm: BlockManager) -> tuple:
    seqs = sorted(bm._tables)
    return (
        bm.num_free_blocks,
        [(s, [list(t) for t in bm.block_tables(s)], bm._starts[s], bm.num_tokens(s), list(bm._keys[s])) for s in seqs],
        [bm.pool.refcount(b) for b in range(bm.pool.num_blocks)],
        list(bm.pool._free), list(bm.prefix_cache._evictable), sorted(bm.prefix_cache._cached.items()),
        list(bm.host.free),
        sorted((s, w.host_tables, w.starts, w.num_tokens, list(w.keys)) for s, w in bm.host.swapped.items()),
        bm.prefix_queries, bm.prefix_hits,
    )


def chain_keys(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The keys of the full blocks of `token_ids`, computed independently of the manager."""
    keys: list[bytes] = []
    parent = b""
    for i in range(len(token_ids) // block_size):
        parent = block_key(parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


def run(bm: BlockManager, seq_id: int, token_ids: list[int]) -> int:
    """Allocate a prompt with prefix matching and commit all of it, as the scheduler would after
    the prefill; returns the reused tokens."""
    hit = bm.allocate(seq_id, len(token_ids), token_ids)
    assert hit is not None
    bm.commit(seq_id, len(token_ids), lambda start, end: token_ids[start:end])
    bm.check_invariants()
    return hit


# ---- BlockPool ----

def test_pool_allocate_until_empty_then_none() -> None:
    pool = BlockPool(3)
    got = [pool.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    assert pool.num_free == 0 and not pool.can_allocate(1) and pool.can_allocate(0)
    assert pool.allocate() is None
    assert all(pool.refcount(b) == 1 for b in got)


def test_pool_double_free_raises() -> None:
    pool = BlockPool(2)
    b = pool.allocate()
    pool.decref(b)
    with pytest.raises(BlockError, match="double free"):
        pool.decref(b)
    assert pool.num_free == 2


def test_pool_incref_free_block_raises_and_shared_block_frees_at_zero() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockError):
        pool.incref(0)
    b = pool.allocate()
    pool.incref(b)
    pool.decref(b)
    assert pool.refcount(b) == 1 and pool.num_free == 1
    pool.decref(b)
    assert pool.refcount(b) == 0 and pool.num_free == 2


# ---- BlockManager ----

def test_blocks_for_is_ceil() -> None:
    bm = BlockManager(4, 4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_none_when_short_changes_nothing() -> None:
    bm = BlockManager(4, 4)
    assert bm.allocate(1, 9) is not None  # 3 blocks
    before = snapshot(bm)
    assert not bm.can_allocate(5)
    assert bm.allocate(2, 5) is None
    assert snapshot(bm) == before
    with pytest.raises(BlockError):
        bm.num_tokens(2)
    assert bm.can_allocate(4) and bm.allocate(2, 4) is not None
    bm.check_invariants()


def test_append_none_when_short_changes_nothing() -> None:
    bm = BlockManager(2, 4)
    bm.allocate(1, 6)
    before = snapshot(bm)
    assert bm.can_append(1, 2) and not bm.can_append(1, 3)
    assert bm.append(1, 3) is None
    assert snapshot(bm) == before
    assert bm.append(1, 2) == []
    assert bm.num_tokens(1) == 8 and bm.num_free_blocks == 0


def test_slot_arithmetic() -> None:
    bm = BlockManager(8, 4)
    bm.allocate(0, 1)  # takes a block so seq 1 gets non-trivial ids
    assert bm.allocate(1, 10) == 0
    table = bm.block_table(1)
    assert len(table) == 3
    expected = [table[p // 4] * 4 + p % 4 for p in range(10)]
    assert [bm.slot(1, p) for p in range(10)] == expected
    assert bm.slots(1, 0, 10) == expected
    assert bm.slots(1, 3, 7) == expected[3:7]
    assert bm.slots(1, 5, 5) == []
    with pytest.raises(IndexError):
        bm.slot(1, 10)
    with pytest.raises(IndexError):
        bm.slots(1, 8, 11)


def test_slot_arithmetic_block_size_one() -> None:
    bm = BlockManager(5, 1)
    assert bm.allocate(3, 4) == 0
    assert bm.slots(3, 0, 4) == bm.block_table(3)


def test_free_unknown_and_double_free_of_seq_raise() -> None:
    bm = BlockManager(4, 4)
    with pytest.raises(BlockError):
        bm.free(99)
    bm.allocate(1, 3)
    bm.free(1)
    with pytest.raises(BlockError):
        bm.free(1)
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_allocate_existing_seq_raises() -> None:
    bm = BlockManager(4, 4)
    bm.allocate(1, 3)
    with pytest.raises(BlockError):
        bm.allocate(1, 3)
    with pytest.raises(BlockError):
        bm.fork(1, 1)


def test_fork_then_append_copies_shared_partial_last_block() -> None:
    bm = BlockManager(8, 4)
    bm.allocate(1, 6)
    parent = list(bm.block_table(1))  # blocks [a, b], b holds positions 4..5
    bm.fork(1, 2)
    assert bm.block_table(2) == parent and bm.num_tokens(2) == 6
    assert all(bm.pool.refcount(b) == 2 for b in parent)
    bm.check_invariants()

    pairs = bm.append(2, 1)
    assert pairs is not None and len(pairs) == 1
    src, dst = pairs[0]
    assert src == parent[1] and dst not in parent
    assert bm.block_table(2) == [parent[0], dst]
    assert bm.block_table(1) == parent
    assert bm.pool.refcount(parent[0]) == 2 and bm.pool.refcount(parent[1]) == 1
    bm.check_invariants()

    # the parent is now the only owner of its last block: no copy
    assert bm.append(1, 1) == []
    # appending zero tokens never copies
    bm.fork(1, 3)
    assert bm.append(3, 0) == []
    bm.check_invariants()


def test_fork_at_block_boundary_needs_no_copy() -> None:
    bm = BlockManager(8, 4)
    bm.allocate(1, 8)
    bm.fork(1, 2)
    free = bm.num_free_blocks
    assert bm.append(2, 1) == []  # new tokens go to a new block, shared blocks stay full
    assert bm.num_free_blocks == free - 1
    bm.check_invariants()


def test_cow_needs_a_free_block() -> None:
    bm = BlockManager(2, 4)
    bm.allocate(1, 2)
    bm.fork(1, 2)
    bm.allocate(3, 1)  # pool now empty
    assert not bm.can_append(2, 1)
    before = snapshot(bm)
    assert bm.append(2, 1) is None
    assert snapshot(bm) == before


def test_check_invariants_detects_corruption() -> None:
    bm = BlockManager(4, 4)
    bm.allocate(1, 5)
    bm.pool._refcounts[bm.block_table(1)[0]] += 1
    with pytest.raises(BlockError, match="refcount"):
        bm.check_invariants()

    bm = BlockManager(4, 4)
    bm.allocate(1, 5)
    bm.pool._free.append(bm.block_table(1)[0])
    with pytest.raises(BlockError):
        bm.check_invariants()

    bm = BlockManager(4, 4)
    bm.pool._free.popleft()  # a block lost: refcount 0, not free, in no table
    with pytest.raises(BlockError, match="lost"):
        bm.check_invariants()


def test_pool_cached_block_goes_evictable_and_is_evicted_last() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, b"k") and not pool.register(b, b"k") and not pool.register(a, b"j")
    pool.decref(a)
    pool.decref(b)
    assert pool.num_free == 2 and pool.cache.num_evictable == 1 and pool.cache.lookup(b"k") == a
    assert pool.allocate() == b  # the free list first
    assert pool.allocate() == a and pool.cache.lookup(b"k") is None and pool.cache.key(a) is None  # evicted
    with pytest.raises(BlockError):
        pool.acquire(a)  # no longer cached


# ---- prefix caching ----

def test_block_key_is_a_chained_blake2b_of_int32_tokens() -> None:
    import struct
    from hashlib import blake2b

    first = block_key(b"", [1, 2, 3])
    assert first == blake2b(struct.pack("<3i", 1, 2, 3), digest_size=16).digest()
    assert block_key(first, [4]) == blake2b(first + struct.pack("<i", 4), digest_size=16).digest()
    assert block_key(first, [4]) != block_key(b"", [4])


def test_shared_prefix_reuses_blocks_and_counts_hits() -> None:
    bm = BlockManager(16, 4)
    a = list(range(14))  # 3 full blocks and 2 tokens
    assert run(bm, 1, a) == 0
    assert bm.prefix_queries == 14 and bm.prefix_hits == 0
    b = a[:12] + [9, 9, 9]
    assert bm.cached_prefix(b) == 12
    free = bm.num_free_blocks
    assert bm.allocate(2, len(b), b) == 12
    assert bm.block_table(2)[:3] == bm.block_table(1)[:3]
    assert bm.block_table(2)[3] != bm.block_table(1)[3]
    assert all(bm.pool.refcount(x) == 2 for x in bm.block_table(1)[:3])
    assert bm.num_free_blocks == free - 1  # only the last block is new
    assert bm._keys[2] == chain_keys(a, 4)[:3]
    assert bm.prefix_queries == 14 + 15 and bm.prefix_hits == 12
    bm.check_invariants()


def test_a_namespace_shares_only_within_itself_through_forks_and_swaps() -> None:
    """Two tenants' roots: the same prompt is cached once per root; a fork and a swapped-out
    sequence keep committing under their own root."""
    bm = BlockManager(32, 4, num_host_blocks=8)
    a, b = b"tenant-a".ljust(16, b"."), b"tenant-b".ljust(16, b".")
    prompt = list(range(10))  # 2 full blocks and 2 tokens
    assert bm.allocate(1, len(prompt), prompt, root=a) == 0
    bm.commit(1, len(prompt), lambda start, end: prompt[start:end])
    assert bm.cached_prefix(prompt, a) == 8 and bm.cached_prefix(prompt, b) == 0 and bm.cached_prefix(prompt) == 0
    assert bm.allocate(2, len(prompt), prompt, root=b) == 0  # b computes its own copy
    assert not set(bm.block_table(2)) & set(bm.block_table(1))
    bm.fork(1, 3)
    longer = prompt + [10, 11, 12, 13, 14, 15]  # the fork fills its third and fourth blocks
    assert bm.append(3, 6) is not None
    pairs = bm.swap_out(3)
    assert pairs is not None and bm.swap_in(3) is not None
    bm.commit(3, len(longer), lambda start, end: longer[start:end])
    assert bm.cached_prefix(longer + [0], a) == 16 and bm.cached_prefix(longer + [0], b) == 0
    for seq in (1, 2, 3):
        bm.free(seq)
    bm.check_invariants()


def test_hits_leave_the_last_token_and_stop_at_num_tokens() -> None:
    bm = BlockManager(16, 4)
    a = list(range(8))
    run(bm, 1, a)
    before = snapshot(bm)
    assert bm.cached_prefix(a) == 4  # 8 cached tokens, but the last one must be computed
    assert bm.cached_prefix(a + [5]) == 8
    assert bm.cached_prefix(a[:4]) == 0 and bm.cached_prefix([]) == 0
    assert snapshot(bm) == before  # a query changes nothing
    assert bm.allocate(2, 8, a) == 4
    assert bm.block_table(2)[0] == bm.block_table(1)[0] and bm.block_table(2)[1] != bm.block_table(1)[1]
    assert bm.allocate(3, 4, a + [5]) == 4  # a first chunk of 4: the hit covers the whole table
    assert bm.block_table(3) == bm.block_table(1)[:1] and bm.num_tokens(3) == 4
    assert bm.allocate(4, 3, a + [5]) == 0 and bm.block_table(4)[0] != bm.block_table(1)[0]
    bm.check_invariants()


def test_freed_cached_blocks_are_evictable_and_reused_by_a_later_prompt() -> None:
    bm = BlockManager(8, 4)
    a = list(range(9))
    run(bm, 1, a)
    old = list(bm.block_table(1))
    bm.free(1)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    bm.check_invariants()
    assert bm.allocate(2, 9, a) == 8
    assert bm.block_table(2)[:2] == old[:2]
    assert bm.num_cached_blocks == 0 and bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert bm.prefix_hits == 8
    bm.check_invariants()


def test_eviction_is_lru_and_takes_a_freed_tail_before_its_head() -> None:
    bm = BlockManager(4, 2)
    a = list(range(7))  # blocks b0 b1 b2 full, b3 holds one token
    run(bm, 1, a)
    b0, b1, b2, b3 = bm.block_table(1)
    bm.free(1)  # tail first: b3 to the free list, then b2, b1, b0 evictable in that order
    assert list(bm.prefix_cache._evictable) == [b2, b1, b0] and list(bm.pool._free) == [b3]
    assert bm.cached_prefix(a) == 6
    bm.allocate(2, 1)
    assert bm.block_table(2) == [b3] and bm.num_cached_blocks == 3  # the free list first
    bm.allocate(3, 2)
    assert bm.block_table(3) == [b2] and bm.cached_prefix(a) == 4
    assert bm.prefix_cache.key(b2) is None
    bm.allocate(4, 2)
    assert bm.block_table(4) == [b1] and bm.cached_prefix(a) == 2
    bm.check_invariants()
    # the head is still cached
    assert bm.allocate(5, 2, a[:3]) == 2 and bm.block_table(5) == [b0]
    bm.check_invariants()


def test_a_taken_key_keeps_its_first_block_and_still_chains() -> None:
    bm = BlockManager(16, 4)
    a = [1, 2, 3, 4, 5]
    assert bm.allocate(1, 5, a) == 0 and bm.allocate(2, 5, a) == 0  # both before either commits
    t1, t2 = list(bm.block_table(1)), list(bm.block_table(2))
    bm.commit(1, 5, lambda s, e: a[s:e])
    bm.commit(2, 5, lambda s, e: a[s:e])
    key = chain_keys(a, 4)[0]
    assert bm._keys[1] == bm._keys[2] == [key]
    assert bm.prefix_cache.lookup(key) == t1[0] and bm.prefix_cache.key(t2[0]) is None
    bm.check_invariants()
    # seq 2's next block chains from the key its first block could not take
    b = a + [6, 7, 8, 9]
    bm.append(2, 4)
    bm.commit(2, 9, lambda s, e: b[s:e])
    assert bm._keys[2] == chain_keys(b, 4)[:2] and bm.prefix_cache.key(t2[1]) == bm._keys[2][1]
    assert bm.allocate(3, 10, b + [0]) == 8 and bm.block_table(3)[:2] == [t1[0], t2[1]]
    bm.free(3)
    bm.free(2)  # its unkeyed first block goes to the free list, its keyed second one is evictable
    assert bm.num_cached_blocks == 1 and t2[0] in bm.pool._free
    bm.check_invariants()


def test_commit_calls_tokens_only_for_newly_full_blocks() -> None:
    bm = BlockManager(8, 4)
    calls: list[tuple[int, int]] = []
    toks = list(range(100, 112))

    def tokens(start: int, end: int) -> list[int]:
        calls.append((start, end))
        return toks[start:end]

    bm.allocate(1, 3)
    bm.commit(1, 3, tokens)
    assert calls == [] and bm._keys[1] == []
    bm.append(1, 6)
    bm.commit(1, 9, tokens)
    assert calls == [(0, 4), (4, 8)] and bm._keys[1] == chain_keys(toks[:8], 4)
    bm.commit(1, 9, tokens)
    bm.commit(1, 5, tokens)
    assert len(calls) == 2
    with pytest.raises(BlockError):
        bm.commit(1, 12, tokens)  # more computed tokens than the table holds
    bm.append(1, 3)
    with pytest.raises(ValueError):
        bm.commit(1, 12, lambda s, e: [1])
    with pytest.raises(BlockError):
        bm.commit(99, 4, tokens)
    bm.check_invariants()


def test_reserve_refuses_an_allocation_that_would_dig_into_it() -> None:
    bm = BlockManager(6, 4)
    assert bm.allocate(1, 8, reserve=4) == 0  # leaves 4
    before = snapshot(bm)
    assert not bm.can_allocate(4, reserve=4) and bm.allocate(2, 4, reserve=4) is None
    assert snapshot(bm) == before
    assert bm.can_allocate(4, reserve=3) and bm.allocate(2, 4, reserve=3) == 0  # leaves 3
    before = snapshot(bm)
    assert not bm.can_append(1, 1, reserve=3) and bm.append(1, 1, reserve=3) is None
    assert snapshot(bm) == before
    assert bm.append(1, 1, reserve=2) == []
    # taking no block is never refused
    assert bm.append(1, 3, reserve=99) == [] and bm.allocate(3, 0, reserve=99) == 0
    bm.check_invariants()


def test_reserve_counts_an_evictable_hit_as_taken() -> None:
    bm = BlockManager(4, 4)
    a = [1, 2, 3, 4, 5]
    run(bm, 1, a)
    bm.free(1)  # one evictable, three free
    assert bm.num_free_blocks == 4
    assert not bm.can_allocate(5, a, reserve=3) and bm.allocate(2, 5, a, reserve=3) is None
    assert bm.prefix_queries == 5  # a refused allocate counts nothing
    assert bm.allocate(2, 5, a, reserve=2) == 4 and bm.num_free_blocks == 2
    # a hit on a block in use takes only the fresh block
    assert bm.can_allocate(5, a, reserve=1) and bm.allocate(3, 5, a, reserve=1) == 4
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_swap_round_trip_of_the_table() -> None:
    bm = BlockManager(8, 4, num_host_blocks=4)
    toks = list(range(12))
    bm.allocate(1, 10)
    bm.commit(1, 8, lambda s, e: toks[s:e])
    table, keys = list(bm.block_table(1)), list(bm._keys[1])
    assert bm.can_swap_out(1)
    out = bm.swap_out(1)
    assert out is not None and [d for d, _ in out] == table
    host = [h for _, h in out]
    assert len(set(host)) == 3 and bm.num_free_host_blocks == 1 and bm.is_swapped(1)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2  # freed exactly like free()
    bm.check_invariants()
    with pytest.raises(BlockError, match="swapped"):
        bm.block_table(1)
    with pytest.raises(BlockError):
        bm.allocate(1, 4)
    with pytest.raises(BlockError):
        bm.free(1)

    bm.allocate(2, 20)  # 5 of 8 device blocks: 3 left
    before = snapshot(bm)
    assert bm.can_swap_in(1) and not bm.can_swap_in(1, reserve=1)
    assert bm.swap_in(1, reserve=1) is None and snapshot(bm) == before
    back = bm.swap_in(1)
    assert back is not None and [h for h, _ in back] == host
    assert [d for _, d in back] == bm.block_table(1) and bm.num_tokens(1) == 10
    assert bm._keys[1] == keys and not bm.is_swapped(1) and bm.num_free_host_blocks == 4
    assert all(bm.prefix_cache.key(b) is None for b in bm.block_table(1))  # not cached again
    bm.check_invariants()
    with pytest.raises(BlockError):
        bm.swap_in(1)
    # commits chain on from the restored keys
    bm.append(1, 2)
    bm.commit(1, 12, lambda s, e: toks[s:e])
    assert bm._keys[1] == chain_keys(toks, 4)
    bm.check_invariants()


def test_swap_out_short_of_host_blocks_and_free_swapped() -> None:
    bm = BlockManager(8, 4, num_host_blocks=2)
    bm.allocate(1, 9)  # 3 blocks
    before = snapshot(bm)
    assert not bm.can_swap_out(1) and bm.swap_out(1) is None and snapshot(bm) == before
    bm.allocate(2, 5)
    bm.fork(2, 3)  # a fork's shared blocks survive its sibling's swap-out
    assert bm.swap_out(2) is not None and bm.num_free_host_blocks == 0
    assert bm.block_table(3) and all(bm.pool.refcount(b) == 1 for b in bm.block_table(3))
    bm.free_swapped(2)
    assert not bm.is_swapped(2) and bm.num_free_host_blocks == 2
    with pytest.raises(BlockError):
        bm.free_swapped(2)
    bm.check_invariants()
    with pytest.raises(BlockError):
        BlockManager(4, 4).swap_out(0)
    no_host = BlockManager(4, 4)
    no_host.allocate(0, 1)
    assert no_host.swap_out(0) is None


def test_caching_disabled_behaves_like_before() -> None:
    off = BlockManager(6, 2, enable_prefix_caching=False)
    plain = BlockManager(6, 2)  # caching on, but never fed token ids or commits: the old manager
    a = [1, 2, 3, 4, 5]
    for bm, ids in ((off, a), (plain, None)):
        assert bm.allocate(1, 5, ids) == 0
        if ids is not None:
            bm.commit(1, 5, lambda s, e: a[s:e])
        bm.fork(1, 2)
        assert bm.append(2, 1) is not None
        bm.free(1)
        assert bm.allocate(3, 5, ids) == 0
        bm.free(2)
        bm.check_invariants()
    assert off.cached_prefix(a) == 0 and off.num_cached_blocks == 0 and not off.prefix_cache._cached
    assert all(keys == [] for keys in off._keys.values())
    assert snapshot(off)[:4] == snapshot(plain)[:4]  # tables, refcounts, free-list order
    assert off.prefix_queries == 10 and off.prefix_hits == 0


def test_check_invariants_detects_cache_and_host_corruption() -> None:
    bm = BlockManager(4, 2)
    run(bm, 1, [1, 2, 3])
    b0 = bm.block_table(1)[0]
    bm.prefix_cache._cached[b"bogus"] = b0
    with pytest.raises(BlockError, match="another key"):
        bm.check_invariants()

    bm = BlockManager(4, 2)
    run(bm, 1, [1, 2, 3])
    b0 = bm.block_table(1)[0]
    bm.free(1)
    bm.pool._free.append(b0)  # evictable and free at once
    with pytest.raises(BlockError, match="misfiled"):
        bm.check_invariants()

    bm = BlockManager(4, 2)
    run(bm, 1, [1, 2, 3])
    bm.prefix_cache._keys[bm.block_table(1)[0]] = None  # mapped, but the block forgot its key
    with pytest.raises(BlockError):
        bm.check_invariants()

    bm = BlockManager(4, 2, num_host_blocks=2)
    bm.host.free.popleft()  # a host block lost
    with pytest.raises(BlockError, match="host block"):
        bm.check_invariants()


# ---- state machine ----

class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate (with prompts that share prefixes) / append / commit / fork / free /
    swap_out / swap_in against a shadow of tables, tokens, and fake device and host caches."""

    @initialize(num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4, 16]),
                num_host_blocks=st.integers(0, 24), caching=st.sampled_from([True, True, False]))
    def setup(self, num_blocks: int, block_size: int, num_host_blocks: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, num_host_blocks, enable_prefix_caching=caching)
        self.tables: dict[int, list[int]] = {}  # shadow: the tables as last seen
        self.tokens: dict[int, list[int]] = {}  # shadow: each live seq's token ids
        self.swapped: dict[int, list[int]] = {}  # shadow: each swapped-out seq's token ids
        self.prompts: list[list[int]] = []  # every prompt so far, to draw shared prefixes from
        # A prefix is named by an int: 0 is the empty prefix, and prefix + [t] is interned as
        # self.prefix_ids[(id of prefix, t)]; self.parent inverts that.
        self.prefix_ids: dict[tuple[int, int], int] = {}
        self.parent: list[tuple[int, int]] = [(-1, -1)]
        self.expected_keys: dict[int, bytes] = {}  # prefix id -> its chain key (memo)
        self.cache = [-1] * (num_blocks * block_size)  # fake KV cache: a prefix id per slot
        self.host = [-1] * (num_host_blocks * block_size)  # fake host cache
        self.next_seq = 0

    # ---- shadow helpers ----

    def _ids(self, token_ids: Sequence[int]) -> list[int]:
        """The prefix id of every position of `token_ids`."""
        ids, current = [], 0
        for t in token_ids:
            current = self.prefix_ids.setdefault((current, t), len(self.parent))
            if current == len(self.parent):
                self.parent.append((ids[-1] if ids else 0, t))
            ids.append(current)
        return ids

    def _key_of(self, prefix_id: int) -> bytes:
        """The chain key a block ending at this prefix must have, from the tokens alone."""
        if prefix_id not in self.expected_keys:
            tokens: list[int] = []
            node = prefix_id
            while node:
                node, t = self.parent[node]
                tokens.append(t)
            tokens.reverse()
            assert len(tokens) % self.bm.block_size == 0
            self.expected_keys[prefix_id] = chain_keys(tokens, self.bm.block_size)[-1]
        return self.expected_keys[prefix_id]

    def _write(self, seq: int, start: int, end: int) -> None:
        """Compute positions [start, end): only into blocks this sequence alone holds, uncached."""
        bm = self.bm
        ids = self._ids(self.tokens[seq])
        table = bm.block_table(seq)
        for p, s in zip(range(start, end), bm.slots(seq, start, end)):
            block = table[p // bm.block_size]
            assert bm.pool.refcount(block) == 1 and bm.prefix_cache.key(block) is None
            self.cache[s] = ids[p]

    def _fits(self, need: int, reserve: int) -> bool:
        return need == 0 or need + reserve <= self.bm.num_free_blocks

    def _copy(self, src: list[int], src_block: int, dst: list[int], dst_block: int) -> None:
        bs = self.bm.block_size
        dst[dst_block * bs:(dst_block + 1) * bs] = src[src_block * bs:(src_block + 1) * bs]

    # ---- rules ----

    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), max_size=40), use_ids=st.booleans(),
          reserve=st.integers(0, 4), commit=st.booleans())
    def allocate(self, data: st.DataObject, suffix: list[int], use_ids: bool, reserve: int, commit: bool) -> None:
        bm, bs = self.bm, self.bm.block_size
        base = data.draw(st.sampled_from(self.prompts)) if self.prompts else []
        prompt = base[:data.draw(st.integers(0, len(base)))] + suffix
        num_tokens = data.draw(st.integers(0, len(prompt)))  # less: a first prefill chunk
        ids = prompt if use_ids else None
        seq, self.next_seq = self.next_seq, self.next_seq + 1

        before = snapshot(bm)
        cached = bm.cached_prefix(prompt)
        assert snapshot(bm) == before
        assert cached % bs == 0 and cached <= max(len(prompt) - 1, 0)
        if not bm.enable_prefix_caching:
            assert cached == 0
        hit_blocks = min(cached, num_tokens) // bs if use_ids else 0
        reused = [bm.prefix_cache.lookup(k) for k in chain_keys(prompt, bs)[:hit_blocks]]
        # fresh blocks, and reused ones that were evictable
        taken = bm.blocks_for(num_tokens) - hit_blocks + sum(bm.pool.refcount(b) == 0 for b in reused)
        fits = self._fits(taken, reserve)
        assert bm.can_allocate(num_tokens, ids, reserve) == fits
        hit = bm.allocate(seq, num_tokens, ids, reserve)
        assert (hit is not None) == fits
        if hit is None:
            assert snapshot(bm) == before
            return
        assert hit == hit_blocks * bs
        table = list(bm.block_table(seq))
        assert len(table) == bm.blocks_for(num_tokens) and table[:hit_blocks] == reused
        assert bm.num_free_blocks == before[0] - taken
        assert taken == 0 or bm.num_free_blocks >= reserve
        assert bm._keys[seq] == chain_keys(prompt, bs)[:hit_blocks]
        if use_ids:
            assert (bm.prefix_queries, bm.prefix_hits) == (before[-2] + len(prompt), before[-1] + hit)
        self.tables[seq] = table
        self.tokens[seq] = prompt[:num_tokens]
        self.prompts.append(prompt)
        self._write(seq, hit, num_tokens)  # the reused part is checked by the invariant
        if commit:
            self._commit(seq, num_tokens)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), max_size=40), reserve=st.integers(0, 4),
          commit=st.booleans())
    def append(self, data: st.DataObject, new: list[int], reserve: int, commit: bool) -> None:
        bm, bs = self.bm, self.bm.block_size
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        n = len(new)
        old_n, old_table = bm.num_tokens(seq), self.tables[seq]
        shared_partial = n > 0 and old_n % bs != 0 and bm.pool.refcount(old_table[-1]) > 1
        need = bm.blocks_for(old_n + n) - len(old_table) + shared_partial
        fits = self._fits(need, reserve)
        assert bm.can_append(seq, n, reserve) == fits
        before = snapshot(bm)
        pairs = bm.append(seq, n, reserve)
        if not fits:
            assert pairs is None and snapshot(bm) == before
            return
        assert pairs is not None
        new_table = list(bm.block_table(seq))
        if shared_partial:
            assert len(pairs) == 1 and pairs[0][0] == old_table[-1]
            assert new_table[: len(old_table)] == old_table[:-1] + [pairs[0][1]]
        else:
            assert pairs == []
            assert new_table[: len(old_table)] == old_table
        for src, dst in pairs:  # what the runner does on the KV tensors
            self._copy(self.cache, src, self.cache, dst)
        self.tables[seq] = new_table
        self.tokens[seq].extend(new)
        self._write(seq, old_n, old_n + n)
        if commit:
            self._commit(seq, old_n + n)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        self._commit(seq, data.draw(st.integers(0, self.bm.num_tokens(seq))))

    def _commit(self, seq: int, num_computed: int) -> None:
        bm, bs = self.bm, self.bm.block_size
        tokens = self.tokens[seq]
        keys_before = list(bm._keys[seq])
        mapped_before = dict(bm.prefix_cache._cached)
        calls: list[tuple[int, int]] = []

        def get(start: int, end: int) -> list[int]:
            calls.append((start, end))
            return tokens[start:end]

        bm.commit(seq, num_computed, get)
        full = num_computed // bs
        if not bm.enable_prefix_caching or full <= len(keys_before):
            assert calls == [] and bm._keys[seq] == keys_before
            return
        assert calls == [(i * bs, (i + 1) * bs) for i in range(len(keys_before), full)]
        assert bm._keys[seq] == chain_keys(tokens, bs)[:full]
        table = self.tables[seq]
        for i in range(len(keys_before), full):
            key, block = bm._keys[seq][i], table[i]
            # cached now: this block, unless another block had the key first
            assert bm.prefix_cache.lookup(key) == mapped_before.get(key, block)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tables)))
        child, self.next_seq = self.next_seq, self.next_seq + 1
        free = self.bm.num_free_blocks
        self.bm.fork(parent, child)
        assert self.bm.num_free_blocks == free  # forking allocates nothing
        assert self.bm._keys[child] == self.bm._keys[parent]
        self.tables[child] = list(self.tables[parent])
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        bm = self.bm
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        table = self.tables[seq]
        last_ref = [b for b in reversed(table) if bm.pool.refcount(b) == 1]
        cached = [b for b in last_ref if bm.prefix_cache.key(b) is not None]
        evictable = list(bm.prefix_cache._evictable)
        bm.free(seq)
        # the blocks that lost their last reference: cached ones join the LRU end, tail first
        assert list(bm.prefix_cache._evictable) == evictable + cached
        del self.tables[seq], self.tokens[seq]
        with pytest.raises(BlockError):
            bm.free(seq)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        bm = self.bm
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        table = self.tables[seq]
        fits = len(table) <= bm.num_free_host_blocks
        assert bm.can_swap_out(seq) == fits
        before = snapshot(bm)
        pairs = bm.swap_out(seq)
        if not fits:
            assert pairs is None and snapshot(bm) == before
            return
        assert pairs is not None and [d for d, _ in pairs] == table
        assert len({h for _, h in pairs}) == len(pairs)
        assert bm.num_free_host_blocks == len(before[6]) - len(pairs)
        for device_block, host_block in pairs:
            self._copy(self.cache, device_block, self.host, host_block)
        assert bm.is_swapped(seq)
        self.swapped[seq] = self.tokens.pop(seq)
        del self.tables[seq]

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), reserve=st.integers(0, 4))
    def swap_in(self, data: st.DataObject, reserve: int) -> None:
        bm = self.bm
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        fits = self._fits(bm.blocks_for(len(self.swapped[seq])), reserve)
        assert bm.can_swap_in(seq, reserve) == fits
        before = snapshot(bm)
        pairs = bm.swap_in(seq, reserve)
        if not fits:
            assert pairs is None and snapshot(bm) == before
            return
        assert pairs is not None and [d for _, d in pairs] == bm.block_table(seq)
        for host_block, device_block in pairs:
            self._copy(self.host, host_block, self.cache, device_block)
        self.tokens[seq] = self.swapped.pop(seq)
        self.tables[seq] = list(bm.block_table(seq))

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def free_swapped(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        self.bm.free_swapped(seq)
        del self.swapped[seq]
        assert not self.bm.is_swapped(seq)

    @invariant()
    def consistent(self) -> None:
        bm, bs = self.bm, self.bm.block_size
        bm.check_invariants()
        refs: Counter[int] = Counter()
        for seq, table in self.tables.items():
            assert bm.block_table(seq) == table
            assert bm.num_tokens(seq) == len(self.tokens[seq])
            refs.update(table)
        for b in range(bm.pool.num_blocks):
            assert bm.pool.refcount(b) == refs[b]
        assert bm.num_used_blocks == len(refs)
        assert bm.num_free_blocks + bm.num_used_blocks == bm.pool.num_blocks
        # every sequence reads back its own prefixes, live ...
        for seq, tokens in self.tokens.items():
            assert [self.cache[s] for s in bm.slots(seq, 0, len(tokens))] == self._ids(tokens)
        # ... or swapped out
        for seq, tokens in self.swapped.items():
            host_table = bm.host.swapped[seq].host_tables[0]
            assert [self.host[host_table[p // bs] * bs + p % bs] for p in range(len(tokens))] == self._ids(tokens)
        # every cached block, used or evictable, holds exactly the prefix its key names
        for key, block in bm.prefix_cache._cached.items():
            contents = self.cache[block * bs:(block + 1) * bs]
            assert all(self.parent[c][0] == prev for prev, c in zip(contents, contents[1:]))
            assert self._key_of(contents[-1]) == key

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        for seq in list(self.tables):
            bm.free(seq)
        for seq in list(self.swapped):
            bm.free_swapped(seq)
        bm.check_invariants()
        assert bm.num_free_blocks == bm.pool.num_blocks and bm.num_used_blocks == 0
        assert bm.num_free_host_blocks == bm.num_host_blocks
        assert all(bm.pool.refcount(b) == 0 for b in range(bm.pool.num_blocks))


def _state_machine_test(examples: int) -> type:
    """The machine as a test case of `examples` runs of up to 50 steps each."""
    case = type(f"BlockManagerMachine{examples}", (BlockManagerMachine.TestCase,), {})
    case.settings = settings(max_examples=examples, stateful_step_count=50, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    return case


test_block_manager_state_machine_in_full = pytest.mark.soak(_state_machine_test(200))
test_block_manager_state_machine = _state_machine_test(50)  # the default tier's twin
