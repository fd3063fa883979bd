"""Paged KV block allocator: refcounted blocks and per-sequence block tables (no tensors here).

The KV cache (allocated elsewhere, once) is, per layer, `[num_blocks, block_size, n_kv_heads,
head_dim]`. A sequence owns a *block table*: the list of block ids that hold its tokens in order.
Token position p lives in block `table[p // block_size]` at offset `p % block_size`, i.e. in the
flat slot `table[p // block_size] * block_size + p % block_size`.

    block_size = 4, sequence of 10 tokens, block table [7, 2, 5]

    positions   0  1  2  3 | 4  5  6  7 | 8  9  .  .
                -----------+------------+-----------
    table idx        0     |      1     |     2          p // 4
    block id         7     |      2     |     5          table[p // 4]
    slots      28 29 30 31 | 8  9 10 11 |20 21 22 23     block * 4 + p % 4
                                               ^^ ^^ free room in the last block: the next
                                                     two appended tokens need no new block

Fork (parallel sampling, beam search) makes the child share every block of the parent (refcount
+1). Full blocks are never written again, so sharing them is free. The last block may be partly
filled; the first sequence that appends to a *shared* partial block gets a fresh copy instead:

    parent [7, 2, 5*]  child [7, 2, 5*]     (5* refcount 2, holds positions 8..9)
    child.append(1) -> copy-on-write pair (5, 4): the caller copies block 5 into block 4 in the
    KV cache, then writes position 10 into block 4.
    parent [7, 2, 5]   child [7, 2, 4]

Check, then act: `can_allocate` / `can_append` answer whether memory suffices; `allocate` and
`append` return None when it does not, and then nothing has changed, so the scheduler can pick a
sequence to preempt and try again.
"""

from __future__ import annotations

from collections import Counter, deque


class BlockError(RuntimeError):
    """A misuse of the allocator (double free, unknown sequence) or a broken invariant."""


class BlockPool:
    """`num_blocks` refcounted blocks; a free block has refcount 0 and sits on the free list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        # NOTE: FIFO reuse (oldest freed block first) keeps recently freed blocks intact longest,
        # which a prefix cache can later exploit; any order is correct.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        block_id = self._free.popleft()
        self._refcounts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        if self._refcounts[block_id] == 0:
            raise BlockError(f"incref of free block {block_id}")
        self._refcounts[block_id] += 1

    def decref(self, block_id: int) -> None:
        rc = self._refcounts[block_id]
        if rc == 0:
            raise BlockError(f"double free of block {block_id}")
        self._refcounts[block_id] = rc - 1
        if rc == 1:
            self._free.append(block_id)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]


class BlockManager:
    """Block tables of all live sequences over one `BlockPool`; the only writer of both."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}

    # ---- queries ----

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_table(self, seq_id: int) -> list[int]:
        """The live table (not a copy): callers read it, never change it."""
        return self._table(seq_id)

    def num_tokens(self, seq_id: int) -> int:
        self._table(seq_id)
        return self._num_tokens[seq_id]

    def slot(self, seq_id: int, position: int) -> int:
        table = self._table(seq_id)
        if not 0 <= position < self._num_tokens[seq_id]:
            raise IndexError(f"position {position} outside seq {seq_id} "
                             f"of {self._num_tokens[seq_id]} tokens")
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slot mapping for positions [start, end)."""
        table = self._table(seq_id)
        if not 0 <= start <= end <= self._num_tokens[seq_id]:
            raise IndexError(f"positions [{start}, {end}) outside seq {seq_id} "
                             f"of {self._num_tokens[seq_id]} tokens")
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---- check ----

    def can_allocate(self, num_tokens: int) -> bool:
        return self.pool.can_allocate(self.blocks_for(num_tokens))

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        return self.pool.can_allocate(self._append_need(seq_id, num_new_tokens)[0])

    # ---- act ----

    def allocate(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """A fresh table for a new sequence of `num_tokens` (the prompt); None if short."""
        if seq_id in self._tables:
            raise BlockError(f"seq {seq_id} already has a block table")
        n = self.blocks_for(num_tokens)
        if not self.pool.can_allocate(n):
            return None
        table = [self._alloc() for _ in range(n)]
        self._tables[seq_id] = table
        self._num_tokens[seq_id] = num_tokens
        return table

    def append(self, seq_id: int, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Make room for `num_new_tokens` more tokens; None if short (then nothing changed).

        Returns the copy-on-write pairs (src_block, dst_block) that the caller must copy in the
        KV cache before writing the new tokens: at most one, when the partly filled last block is
        shared with a fork.
        """
        table = self._tables.get(seq_id)
        if table is not None and num_new_tokens >= 0:
            # NOTE: the common decode case, kept cheap: the tokens fit in the room left in the last
            # block and that block is not shared, so no block is allocated or copied.
            total = self._num_tokens[seq_id] + num_new_tokens
            if total <= len(table) * self.block_size and (
                num_new_tokens == 0 or self.pool._refcounts[table[-1]] == 1
            ):
                self._num_tokens[seq_id] = total
                return []
        need, cow = self._append_need(seq_id, num_new_tokens)
        if not self.pool.can_allocate(need):
            return None
        table = self._tables[seq_id]
        pairs: list[tuple[int, int]] = []
        if cow:
            src = table[-1]
            dst = self._alloc()
            self.pool.decref(src)  # still held by the fork(s): refcount >= 1
            table[-1] = dst
            pairs.append((src, dst))
        total = self._num_tokens[seq_id] + num_new_tokens
        for _ in range(self.blocks_for(total) - len(table)):
            table.append(self._alloc())
        self._num_tokens[seq_id] = total
        return pairs

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares all the parent's blocks and has the same token count."""
        table = self._table(parent_id)
        if child_id in self._tables:
            raise BlockError(f"seq {child_id} already has a block table")
        for block_id in table:
            self.pool.incref(block_id)
        self._tables[child_id] = list(table)
        self._num_tokens[child_id] = self._num_tokens[parent_id]

    def free(self, seq_id: int) -> None:
        table = self._table(seq_id)
        # NOTE: tail first, so that with FIFO reuse a sequence's prefix blocks are reused last.
        for block_id in reversed(table):
            self.pool.decref(block_id)
        del self._tables[seq_id]
        del self._num_tokens[seq_id]

    def check_invariants(self) -> None:
        """Raise BlockError if a block is lost, free twice, or refcounted wrongly. O(blocks)."""
        pool = self.pool
        refs: Counter[int] = Counter()
        for seq_id, table in self._tables.items():
            if len(table) != self.blocks_for(self._num_tokens[seq_id]):
                raise BlockError(f"seq {seq_id}: {len(table)} blocks for "
                                 f"{self._num_tokens[seq_id]} tokens")
            refs.update(table)
        free = Counter(pool._free)
        for block_id in range(pool.num_blocks):
            rc = pool.refcount(block_id)
            on_free = free[block_id]
            if on_free > 1:
                raise BlockError(f"block {block_id} is {on_free} times on the free list")
            if rc != refs[block_id]:
                raise BlockError(f"block {block_id}: refcount {rc} != {refs[block_id]} references")
            if (rc == 0) != (on_free == 1):
                state = "free" if on_free else "not free"
                raise BlockError(f"block {block_id}: refcount {rc} but {state} (lost or misfiled)")
        unknown = [b for b in free if not 0 <= b < pool.num_blocks]
        if unknown:
            raise BlockError(f"free list holds unknown block ids {unknown}")

    # ---- internals ----

    def _table(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise BlockError(f"unknown seq {seq_id}") from None

    def _alloc(self) -> int:
        block_id = self.pool.allocate()
        assert block_id is not None, "caller checked can_allocate"
        return block_id

    def _append_need(self, seq_id: int, num_new_tokens: int) -> tuple[int, bool]:
        """(blocks to allocate, whether the last block needs copy-on-write) for an append."""
        table = self._table(seq_id)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        n = self._num_tokens[seq_id]
        cow = (num_new_tokens > 0 and n % self.block_size != 0
               and self.pool.refcount(table[-1]) > 1)
        need = self.blocks_for(n + num_new_tokens) - len(table) + cow
        return need, cow
