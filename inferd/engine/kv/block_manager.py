"""Per-sequence block tables over the paged KV block pool, and host copies of swapped-out
sequences (no tensors here). The scheduler's check-then-act API to KV memory.

    block_manager  tables, token counts, copy-on-write, swap      (this module)
    block_pool     refcounts and the free list                    BlockPool
    prefix_cache   block keys, lookup, evictable LRU              PrefixCache, block_key

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

Prefix caching: once a block is full and computed, `commit` files it in the prefix cache under a
key that hashes its tokens and every token before them. `allocate` with the prompt's token ids
reuses the leading cached blocks, and the caller computes from the first position they miss:

    block_size = 4     a: [1 2 3 4 | 5 6 7 8 | 9 .  .  . ]   committed: both full blocks cached
                       b: [1 2 3 4 | 5 6 7 8 | 9 9 .  . ]   allocate(b, 10, token_ids=b) -> 8
                           ^ same block ^ same block  ^ fresh block, computed from position 8

A freed block that is still cached stays *evictable* (see block_pool.py for the three states).

Swap: `swap_out` gives a sequence's blocks host copies and frees its device blocks; `swap_in`
brings them back into fresh device blocks. The caller copies the returned pairs, in one step, in
this order: swap-out pairs, swap-in pairs, copy-on-write pairs, then runs the model.

Check, then act: `can_allocate` / `can_append` / `can_swap_in` / `can_swap_out` answer whether
memory suffices; `allocate`, `append`, `swap_in` and `swap_out` return None when it does not, and
then nothing has changed, so the scheduler can pick a sequence to preempt and try again.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inferd.engine.kv.block_pool import BlockPool
from inferd.engine.kv.prefix_cache import BlockError, PrefixCache


@dataclass(slots=True)
class SwappedSeq:
    """What a swapped-out sequence needs to come back: its host blocks, in table order."""

    host_table: list[int]
    num_tokens: int
    keys: list[bytes]  # the keys of its full computed blocks, for chaining later commits
    root: bytes  # its prefix-cache namespace


class BlockManager:
    """Block tables of all live sequences over one `BlockPool` and its `PrefixCache`; the only
    writer of all three."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.pool = BlockPool(num_blocks)
        self.prefix_cache: PrefixCache = self.pool.cache
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}
        # per live sequence: the keys of its first len(keys) blocks, all full and computed
        self._keys: dict[int, list[bytes]] = {}
        # per live sequence: its prefix-cache namespace, the first block's parent key (b"": shared)
        self._roots: dict[int, bytes] = {}
        self.num_host_blocks = num_host_blocks
        self._host_free: deque[int] = deque(range(num_host_blocks))
        self._swapped: dict[int, SwappedSeq] = {}
        # metrics: prompt tokens looked up in, and served from, the prefix cache by `allocate`
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- queries ----

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus evictable."""
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Evictable blocks: freed, but still holding a cached prefix."""
        return self.prefix_cache.num_evictable

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    def block_table(self, seq_id: int) -> list[int]:
        """The live table (not a copy): callers read it, never change it."""
        return self._table(seq_id)

    def num_tokens(self, seq_id: int) -> int:
        self._table(seq_id)
        return self._num_tokens[seq_id]

    def is_swapped(self, seq_id: int) -> bool:
        return seq_id in self._swapped

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

    def cached_prefix(self, token_ids: Sequence[int] | None, root: bytes = b"") -> int:
        """How many leading tokens cached blocks hold in namespace `root`: a multiple of
        block_size, at most len(token_ids) - 1 (the last token is always computed, for its
        logits); 0 without token ids (a sequence that reuses nothing). Changes nothing."""
        if not self.enable_prefix_caching or token_ids is None:
            return 0
        return len(self.prefix_cache.match(token_ids, len(token_ids) - 1, self.block_size, root)[0]) * self.block_size

    # ---- check ----

    def can_allocate(self, num_tokens: int, token_ids: Sequence[int] | None = None, reserve: int = 0,
                     root: bytes = b"") -> bool:
        return self._fits(self._allocate_plan(num_tokens, token_ids, root)[2], reserve)

    def can_append(self, seq_id: int, num_new_tokens: int, reserve: int = 0) -> bool:
        return self._fits(self._append_need(seq_id, num_new_tokens)[0], reserve)

    def can_swap_out(self, seq_id: int) -> bool:
        return len(self._table(seq_id)) <= len(self._host_free)

    def num_swapped_blocks(self, seq_id: int) -> int:
        return len(self._swapped_seq(seq_id).host_table)

    def can_swap_in(self, seq_id: int, reserve: int = 0) -> bool:
        return self._fits(len(self._swapped_seq(seq_id).host_table), reserve)

    # ---- act ----

    def allocate(self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None,
                 reserve: int = 0, root: bytes = b"") -> int | None:
        """A fresh table covering the first `num_tokens` tokens of a new sequence.

        With `token_ids` (the prompt) and prefix caching on, the leading cached blocks are reused,
        up to `num_tokens` and len(token_ids) - 1 tokens, from the namespace `root` (and its full
        blocks are cached there as they are computed). Returns how many tokens the reused blocks
        hold (0 without a hit; the caller computes from there), or None if fewer than
        `reserve` blocks would be left allocatable (then nothing changed).
        """
        self._check_new(seq_id)
        hit_blocks, hit_keys, need = self._allocate_plan(num_tokens, token_ids, root)
        if not self._fits(need, reserve):
            return None
        # NOTE: hits first, so that the fresh allocations below cannot evict them.
        for block_id in hit_blocks:
            self.pool.acquire(block_id)
        table = hit_blocks + [self._alloc() for _ in range(self.blocks_for(num_tokens) - len(hit_blocks))]
        self._tables[seq_id] = table
        self._num_tokens[seq_id] = num_tokens
        self._keys[seq_id] = hit_keys
        self._roots[seq_id] = root
        hit_tokens = len(hit_blocks) * self.block_size
        if token_ids is not None:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += hit_tokens
        return hit_tokens

    def append(self, seq_id: int, num_new_tokens: int, reserve: int = 0) -> list[tuple[int, int]] | None:
        """Make room for `num_new_tokens` more tokens; None if short (then nothing changed).

        Returns the copy-on-write pairs (src_block, dst_block) that the caller must copy in the
        KV cache before writing the new tokens: at most one, when the partly filled last block is
        shared with a fork.
        """
        table = self._tables.get(seq_id)
        if table is not None and num_new_tokens >= 0:
            # NOTE: the common decode case, kept cheap: the tokens fit in the room left in the last
            # block and that block is not shared, so no block is allocated or copied (and so the
            # reserve, which only limits taking blocks, cannot refuse it).
            total = self._num_tokens[seq_id] + num_new_tokens
            if total <= len(table) * self.block_size and (
                num_new_tokens == 0 or self.pool._refcounts[table[-1]] == 1
            ):
                self._num_tokens[seq_id] = total
                return []
        need, cow = self._append_need(seq_id, num_new_tokens)
        if not self._fits(need, reserve):
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

    def commit(self, seq_id: int, num_computed_tokens: int, tokens: Callable[[int, int], Sequence[int]]) -> None:
        """Cache every block that the first `num_computed_tokens` tokens now fill.

        `tokens(start, end)` returns the sequence's token ids [start, end); it is called once per
        newly full block, so calling commit after every step costs O(1) when none became full.
        A block whose key another block already holds stays uncached (and is freed as usual).
        """
        keys = self._keys.get(seq_id)
        if keys is None:
            raise BlockError(f"unknown seq {seq_id}")
        num_full = num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= len(keys):
            return
        if num_computed_tokens > self._num_tokens[seq_id]:
            raise BlockError(f"seq {seq_id}: {num_computed_tokens} computed tokens but room "
                             f"for {self._num_tokens[seq_id]}")
        self.prefix_cache.fill(self._tables[seq_id], keys, num_full, tokens, self.block_size, self._roots[seq_id])

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares all the parent's blocks and has the same token count."""
        table = self._table(parent_id)
        self._check_new(child_id)
        for block_id in table:
            self.pool.incref(block_id)
        self._tables[child_id] = list(table)
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        self._keys[child_id] = list(self._keys[parent_id])
        self._roots[child_id] = self._roots[parent_id]

    def free(self, seq_id: int) -> None:
        table = self._table(seq_id)
        # NOTE: tail first: with FIFO reuse a sequence's prefix blocks are reused last, and the
        # tail of a cached prefix is evicted before its head (a tail is no use without its head).
        for block_id in reversed(table):
            self.pool.decref(block_id)
        del self._tables[seq_id]
        del self._num_tokens[seq_id]
        del self._keys[seq_id]
        del self._roots[seq_id]

    def swap_out(self, seq_id: int) -> list[tuple[int, int]] | None:
        """Copy a sequence to host blocks and free its device blocks; None if host blocks are short.

        Returns the (device_block, host_block) pairs the caller copies before anything else this
        step. The freed device blocks may be handed out again in the same step.
        """
        table = self._table(seq_id)
        if len(table) > len(self._host_free):
            return None
        host_table = [self._host_free.popleft() for _ in table]
        pairs = list(zip(table, host_table))
        self._swapped[seq_id] = SwappedSeq(host_table, self._num_tokens[seq_id], self._keys[seq_id],
                                           self._roots[seq_id])
        self.free(seq_id)
        return pairs

    def swap_in(self, seq_id: int, reserve: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped-out sequence back into fresh device blocks; None if short.

        Returns the (host_block, device_block) pairs to copy (after the swap-out pairs). The new
        blocks are not cached again, even where the old ones were.
        """
        swapped = self._swapped_seq(seq_id)
        if not self._fits(len(swapped.host_table), reserve):
            return None
        table = [self._alloc() for _ in swapped.host_table]
        del self._swapped[seq_id]
        self._host_free.extend(swapped.host_table)
        self._tables[seq_id] = table
        self._num_tokens[seq_id] = swapped.num_tokens
        self._keys[seq_id] = swapped.keys
        self._roots[seq_id] = swapped.root
        return list(zip(swapped.host_table, table))

    def free_swapped(self, seq_id: int) -> None:
        """Drop a sequence that finished (or was aborted) while swapped out."""
        swapped = self._swapped_seq(seq_id)
        del self._swapped[seq_id]
        self._host_free.extend(swapped.host_table)

    def check_invariants(self) -> None:
        """Raise BlockError if a block is lost, misfiled or refcounted wrongly, the cache map and
        the blocks' keys disagree, or a host block is lost or held twice. O(blocks)."""
        if self._keys.keys() != self._tables.keys() or self._roots.keys() != self._tables.keys():
            raise BlockError("sequences with keys and with tables differ")
        refs: Counter[int] = Counter()
        for seq_id, table in self._tables.items():
            n = self._num_tokens[seq_id]
            if len(table) != self.blocks_for(n):
                raise BlockError(f"seq {seq_id}: {len(table)} blocks for {n} tokens")
            if len(self._keys[seq_id]) > n // self.block_size:
                raise BlockError(f"seq {seq_id}: {len(self._keys[seq_id])} keys for {n} tokens")
            refs.update(table)
        if not self.enable_prefix_caching and (len(self.prefix_cache) or any(self._keys.values())):
            raise BlockError("prefix caching is off but blocks are cached")
        self.pool.check_invariants(refs)  # and the prefix cache's own
        self._check_host()

    def _check_host(self) -> None:
        """Swapped sequences are not live, and each host block is free or held by one of them."""
        if self._swapped.keys() & self._tables.keys():
            raise BlockError(f"seqs {self._swapped.keys() & self._tables.keys()} are live and swapped")
        host_refs = Counter(self._host_free)
        for seq_id, swapped in self._swapped.items():
            if len(swapped.host_table) != self.blocks_for(swapped.num_tokens):
                raise BlockError(f"swapped seq {seq_id}: {len(swapped.host_table)} host blocks "
                                 f"for {swapped.num_tokens} tokens")
            if len(swapped.keys) > swapped.num_tokens // self.block_size:
                raise BlockError(f"swapped seq {seq_id}: {len(swapped.keys)} keys "
                                 f"for {swapped.num_tokens} tokens")
            host_refs.update(swapped.host_table)
        for host_id in range(self.num_host_blocks):
            if host_refs[host_id] != 1:
                raise BlockError(f"host block {host_id} is held {host_refs[host_id]} times (free or swapped)")
        unknown = [h for h in host_refs if not 0 <= h < self.num_host_blocks]
        if unknown:
            raise BlockError(f"unknown host block ids {unknown}")

    # ---- internals ----

    def _table(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            state = " (swapped out)" if seq_id in self._swapped else ""
            raise BlockError(f"unknown seq {seq_id}{state}") from None

    def _swapped_seq(self, seq_id: int) -> SwappedSeq:
        try:
            return self._swapped[seq_id]
        except KeyError:
            raise BlockError(f"seq {seq_id} is not swapped out") from None

    def _check_new(self, seq_id: int) -> None:
        if seq_id in self._tables or seq_id in self._swapped:
            raise BlockError(f"seq {seq_id} already has a block table")

    def _alloc(self) -> int:
        block_id = self.pool.allocate()
        assert block_id is not None, "caller checked can_allocate"
        return block_id

    def _fits(self, need: int, reserve: int) -> bool:
        """Whether `need` blocks can be taken leaving `reserve` allocatable. Taking none always
        fits: the reserve limits what an allocation takes, not what others left."""
        return need <= 0 or need + reserve <= self.pool.num_free

    def _allocate_plan(self, num_tokens: int, token_ids: Sequence[int] | None,
                       root: bytes = b"") -> tuple[list[int], list[bytes], int]:
        """(cached blocks to reuse, their keys, blocks the allocation takes from the allocatable
        ones): fresh blocks, plus reused blocks that were evictable."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        blocks: list[int] = []
        keys: list[bytes] = []
        if token_ids is not None and self.enable_prefix_caching:
            blocks, keys = self.prefix_cache.match(token_ids, min(len(token_ids) - 1, num_tokens), self.block_size,
                                                   root)
        refcount = self.pool.refcount
        need = self.blocks_for(num_tokens) - len(blocks) + sum(refcount(b) == 0 for b in blocks)
        return blocks, keys, need

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
