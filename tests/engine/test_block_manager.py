"""BlockPool / BlockManager: unit tests, then a hypothesis state machine against a shadow model.

The state machine also keeps a fake KV cache (one int per slot): every appended token writes a
unique value into its slot after the copy-on-write pairs are applied, and every sequence must read
back exactly its own tokens. That catches sharing bugs the refcount checks alone would miss.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inferd.engine.block_manager import BlockError, BlockManager, BlockPool


def snapshot(bm: BlockManager) -> tuple:
    seqs = sorted(bm._tables)
    return (
        bm.num_free_blocks,
        [(s, list(bm.block_table(s)), bm.num_tokens(s)) for s in seqs],
        [bm.pool.refcount(b) for b in range(bm.pool.num_blocks)],
    )


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
    table = bm.allocate(1, 10)
    assert table is not None and len(table) == 3
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
    table = bm.allocate(3, 4)
    assert bm.slots(3, 0, 4) == table


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
    parent = list(bm.allocate(1, 6))  # blocks [a, b], b holds positions 4..5
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


# ---- state machine ----

class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free against a shadow of tables and token contents."""

    @initialize(num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 4, 16]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.tables: dict[int, list[int]] = {}  # shadow: the tables as last returned
        self.tokens: dict[int, list[int]] = {}  # shadow: the token values each seq wrote
        self.cache = [-1] * (num_blocks * block_size)  # fake KV cache, one value per slot
        self.next_seq = 0
        self.next_value = 0

    def _write(self, seq: int, start: int, end: int) -> None:
        for s in self.bm.slots(seq, start, end):
            self.cache[s] = self.next_value
            self.tokens[seq].append(self.next_value)
            self.next_value += 1

    @rule(num_tokens=st.integers(0, 80))
    def allocate(self, num_tokens: int) -> None:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        fits = self.bm.blocks_for(num_tokens) <= self.bm.num_free_blocks
        assert self.bm.can_allocate(num_tokens) == fits
        before = snapshot(self.bm)
        table = self.bm.allocate(seq, num_tokens)
        if not fits:
            assert table is None and snapshot(self.bm) == before
            return
        assert table is not None and len(table) == self.bm.blocks_for(num_tokens)
        self.tables[seq] = list(table)
        self.tokens[seq] = []
        self._write(seq, 0, num_tokens)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), n=st.integers(0, 40))
    def append(self, data: st.DataObject, n: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        bs = self.bm.block_size
        old_n, old_table = self.bm.num_tokens(seq), self.tables[seq]
        shared_partial = n > 0 and old_n % bs != 0 and self.bm.pool.refcount(old_table[-1]) > 1
        need = self.bm.blocks_for(old_n + n) - len(old_table) + shared_partial
        fits = need <= self.bm.num_free_blocks
        assert self.bm.can_append(seq, n) == fits
        before = snapshot(self.bm)
        pairs = self.bm.append(seq, n)
        if not fits:
            assert pairs is None and snapshot(self.bm) == before
            return
        assert pairs is not None
        new_table = list(self.bm.block_table(seq))
        if shared_partial:
            assert len(pairs) == 1 and pairs[0][0] == old_table[-1]
            assert new_table[: len(old_table)] == old_table[:-1] + [pairs[0][1]]
        else:
            assert pairs == []
            assert new_table[: len(old_table)] == old_table
        for src, dst in pairs:  # what the runner does on the KV tensors
            self.cache[dst * bs:(dst + 1) * bs] = self.cache[src * bs:(src + 1) * bs]
        self.tables[seq] = new_table
        self._write(seq, old_n, old_n + n)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tables)))
        child, self.next_seq = self.next_seq, self.next_seq + 1
        free = self.bm.num_free_blocks
        self.bm.fork(parent, child)
        assert self.bm.num_free_blocks == free  # forking allocates nothing
        self.tables[child] = list(self.tables[parent])
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        self.bm.free(seq)
        del self.tables[seq], self.tokens[seq]
        with pytest.raises(BlockError):
            self.bm.free(seq)

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        bm.check_invariants()
        refs: Counter[int] = Counter()
        for seq, table in self.tables.items():
            assert bm.block_table(seq) == table
            assert bm.num_tokens(seq) == len(self.tokens[seq])
            refs.update(table)
        for b in range(bm.pool.num_blocks):
            assert bm.pool.refcount(b) == refs[b]
        assert bm.num_free_blocks + len(refs) == bm.pool.num_blocks
        for seq, values in self.tokens.items():  # every sequence reads back its own tokens
            assert [self.cache[s] for s in bm.slots(seq, 0, len(values))] == values

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in list(self.tables):
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.pool.num_blocks
        assert all(self.bm.pool.refcount(b) == 0 for b in range(self.bm.pool.num_blocks))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
