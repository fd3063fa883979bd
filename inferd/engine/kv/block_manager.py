"""Per-sequence block tables over the paged KV block pool, and host copies of swapped-out
sequences (no tensors here). The scheduler's check-then-act API to KV memory.

    block_manager  tables, token counts, copy-on-write, swap      (this module)
    groups         which layers share a table; sliding windows    KVLayout, first_needed_block
    cache_tiers    the host tier, sessions, why a prompt missed   CacheTiers
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

Fork (parallel sampling) makes the child share every block of the parent (refcount +1): full
blocks are never written again. The first sequence that appends to a *shared*, partly filled last
block gets a copy instead: parent and child [7, 2, 5*] (5* shared) -> child.append(1) returns the
copy-on-write pair (5, 4); the caller copies block 5 into 4, then writes there: child [7, 2, 4].

Prefix caching: once a block is full and computed, `commit` files it in the prefix cache under a
key that hashes its tokens and every token before them (prefix_cache.py draws it). `allocate`
with the prompt's token ids reuses the leading cached blocks and returns how many tokens they
hold; the caller computes from there. A freed block that is still cached stays *evictable*
(see block_pool.py for the three states).

KV groups (kv/groups.py): one table per group, all of one length, over the one pool; a sliding
group gives back the blocks before its window. State slots (kv/state_slots.py): a hybrid model's
prefix hit is cut back to a state checkpoint. Swap (kv/host.py): `swap_out` copies a sequence to
host blocks, `swap_in` brings it back into fresh ones. Speculation: `truncate` gives back the
room rejected drafts took. Cache tiers (kv/cache_tiers.py): a prompt's hit goes on into the host
tier, and sessions' blocks are evicted after anonymous ones (`retain`).

Check, then act: `can_allocate` / `can_append` / `can_swap_in` / `can_swap_out` answer whether
memory suffices; `allocate`, `append`, `swap_in` and `swap_out` return None when it does not (and
nothing has changed), so the scheduler can pick a sequence to preempt and try again.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from inferd.engine.kv.block_pool import BlockPool
from inferd.engine.kv.cache_tiers import CacheTiers, PrefixHit
from inferd.engine.kv.events import KVEventRecorder
from inferd.engine.kv.groups import first_needed_block
from inferd.engine.kv.host import HostBlocks
from inferd.engine.kv.prefix_cache import BlockError, PrefixCache, check_tables
from inferd.engine.kv.state_slots import StateSlots
from inferd.engine.protocol import Session


class BlockManager:
    """Block tables of all live sequences over one `BlockPool` and its `PrefixCache`; the only
    writer of all three. `windows`: per KV group, its sliding window or None (kv/groups.py)."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, windows: Sequence[int | None] = (None,),
                 state: StateSlots | None = None, num_tier_blocks: int = 0, clock: Callable[[], float] = time.monotonic,
                 session_share: float = 1.0, events: KVEventRecorder | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must be None or >= 1, one per KV group, got {windows}")
        self.pool = BlockPool(num_blocks)
        self.prefix_cache: PrefixCache = self.pool.cache
        # the host tier (num_tier_blocks), session retention, miss reasons and KV events (kv/cache_tiers.py)
        self.tiers = CacheTiers(self.prefix_cache, num_blocks, block_size, num_tier_blocks, clock, session_share, state,
                                events)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self._sliding = [g for g, w in enumerate(self.windows) if w is not None]
        # a group's cached blocks are filed under key + its tag: a block is one group's only
        self._tags = [b"" if g == 0 else bytes([g]) for g in range(len(self.windows))]
        self._tables: dict[int, list[list[int]]] = {}  # per live sequence, one table per group
        # per live sequence and group: the first table entry it holds (the entries before it are
        # 0 and hold nothing: out of a sliding window); always 0 for a full group
        self._starts: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}
        # per live sequence: the keys of its first len(keys) blocks, all full and computed
        self._keys: dict[int, list[bytes]] = {}
        # per live sequence: its prefix-cache namespace, the first block's parent key (b"": shared)
        self._roots: dict[int, bytes] = {}
        self.state = state  # a hybrid model's state slots (None: attention layers only)
        self.host = HostBlocks(num_host_blocks)
        self.num_host_blocks = num_host_blocks
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
        return len(self.host.free)

    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        """The live table of one KV group (not a copy): callers read it, never change it."""
        return self._table(seq_id)[group]

    def block_tables(self, seq_id: int) -> list[list[int]]:
        """The live tables, one per KV group (not copies)."""
        return self._table(seq_id)

    def num_held_blocks(self, seq_id: int) -> int:
        """Blocks the sequence holds, over all groups."""
        tables, starts = self._table(seq_id), self._starts[seq_id]
        return sum(len(t) - s for t, s in zip(tables, starts))

    def num_tokens(self, seq_id: int) -> int:
        self._table(seq_id)
        return self._num_tokens[seq_id]

    def is_swapped(self, seq_id: int) -> bool:
        return seq_id in self.host.swapped

    def slots(self, seq_id: int, start: int, end: int, group: int = 0) -> list[int]:
        """Slot mapping for positions [start, end) in one group's table."""
        table = self._table(seq_id)[group]
        if not 0 <= start <= end <= self._num_tokens[seq_id]:
            raise IndexError(f"positions [{start}, {end}) outside seq {seq_id} "
                             f"of {self._num_tokens[seq_id]} tokens")
        if start < self._starts[seq_id][group] * self.block_size:
            raise IndexError(f"position {start} of seq {seq_id} is out of group {group}'s window")
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def slot(self, seq_id: int, position: int, group: int = 0) -> int:
        return self.slots(seq_id, position, position + 1, group)[0]

    def cached_prefix(self, token_ids: Sequence[int] | None, root: bytes = b"") -> int:
        """How many leading tokens cached blocks hold in namespace `root`: a multiple of
        block_size, at most len(token_ids) - 1 (the last token is always computed, for its
        logits); 0 without token ids (a sequence that reuses nothing). Changes nothing."""
        if not self.enable_prefix_caching or token_ids is None:
            return 0
        return len(self._match(token_ids, len(token_ids) - 1, root).keys) * self.block_size

    # ---- check ----

    def can_allocate(self, num_tokens: int, token_ids: Sequence[int] | None = None, reserve: int = 0,
                     root: bytes = b"") -> bool:
        return self._seat() and self._fits(self._allocate_plan(num_tokens, token_ids, root)[1], reserve)

    def can_append(self, seq_id: int, num_new_tokens: int, reserve: int = 0) -> bool:
        return self._fits(self._append_need(seq_id, num_new_tokens)[0], reserve)

    def can_swap_out(self, seq_id: int) -> bool:
        if self.state is not None and not self.state.can_swap_out():
            return False
        return self.num_held_blocks(seq_id) <= len(self.host.free)

    def num_swapped_blocks(self, seq_id: int) -> int:
        return self.host.get(seq_id).num_blocks

    def can_swap_in(self, seq_id: int, reserve: int = 0) -> bool:
        return self._seat() and self._fits(self.num_swapped_blocks(seq_id), reserve)

    # ---- act ----

    def allocate(self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None,
                 reserve: int = 0, root: bytes = b"") -> int | None:
        """Fresh tables covering the first `num_tokens` tokens of a new sequence.

        With `token_ids` (the prompt) and prefix caching on, the leading cached blocks are reused,
        up to `num_tokens` and len(token_ids) - 1 tokens, from the namespace `root` (and its full
        blocks are cached there as they are computed). Returns how many tokens the reused blocks
        hold (0 without a hit; the caller computes from there), or None if fewer than
        `reserve` blocks would be left allocatable (then nothing changed).
        """
        self._check_new(seq_id)
        hit, need = self._allocate_plan(num_tokens, token_ids, root)
        if not self._fits(need, reserve) or not self._seat():
            return None
        num_hit = len(hit.keys)
        if self.state is not None:
            self.state.start_prompt(seq_id, hit.keys, hit.attention_hit, self.block_size)
        starts = [first_needed_block(w, num_hit * self.block_size, self.block_size) for w in self.windows]
        # NOTE: hits first, so that the fresh allocations below cannot evict them.
        held = [b for blocks, start in zip(hit.blocks, starts) for b in blocks[start:] if b is not None]
        for block_id in held:
            self.pool.acquire(block_id)
        if hit.from_host:
            self.tiers.onload(hit, self._alloc, self.pool.register)
        fresh = self.blocks_for(num_tokens) - num_hit
        self._tables[seq_id] = [[0] * start + blocks[start:] + [self._alloc() for _ in range(fresh)]
                                for blocks, start in zip(hit.blocks, starts)]  # type: ignore[misc]
        self._starts[seq_id] = starts
        self._num_tokens[seq_id] = num_tokens
        self._keys[seq_id] = hit.keys
        self._roots[seq_id] = root
        self.tiers.note_hit(seq_id, hit, held)
        hit_tokens = num_hit * self.block_size
        if token_ids is not None:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += hit_tokens
        return hit_tokens

    def retain(self, seq_id: int, session: Session | None, tenant: str | None,
               tokens: Callable[[int, int], Sequence[int]]) -> None:
        """Before `free`, for a sequence of a session (else nothing): hold its cached blocks for
        the session's next turn (kv/retention.py). `tokens(start, end)`: its token ids."""
        if session is not None and self.enable_prefix_caching:
            keys = self._keys[seq_id]
            self.tiers.retain(session, tenant, keys, self._tags, tokens(0, len(keys) * self.block_size))

    def append(self, seq_id: int, num_new_tokens: int, reserve: int = 0) -> list[tuple[int, int]] | None:
        """Make room for `num_new_tokens` more tokens; None if short (then nothing changed).

        Returns the copy-on-write pairs (src_block, dst_block) that the caller must copy in the
        KV cache before writing the new tokens: at most one per group, when a partly filled last
        block is shared with a fork.
        """
        tables = self._tables.get(seq_id)
        if tables is not None and num_new_tokens >= 0:
            # NOTE: the common decode case, kept cheap: the tokens fit in the room left in the last
            # block and that block is not shared, so no block is allocated or copied (and so the
            # reserve, which only limits taking blocks, cannot refuse it).
            total = self._num_tokens[seq_id] + num_new_tokens
            refcounts = self.pool._refcounts
            if total <= len(tables[0]) * self.block_size and (num_new_tokens == 0 or refcounts[tables[0][-1]] == 1 and (
                len(tables) == 1 or all(refcounts[t[-1]] == 1 for t in tables))):
                self._num_tokens[seq_id] = total
                return []
        need, cow = self._append_need(seq_id, num_new_tokens)
        if not self._fits(need, reserve):
            return None
        tables = self._tables[seq_id]
        pairs: list[tuple[int, int]] = []
        for g in cow:
            src = tables[g][-1]
            dst = self._alloc()
            self.pool.decref(src)  # still held by the fork(s): refcount >= 1
            tables[g][-1] = dst
            pairs.append((src, dst))
        total = self._num_tokens[seq_id] + num_new_tokens
        for table in tables:
            for _ in range(self.blocks_for(total) - len(table)):
                table.append(self._alloc())
        self._num_tokens[seq_id] = total
        return pairs

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Give back the room past the first `num_tokens` tokens (a speculative step's rejected
        drafts), tail first. Those blocks were never committed: commit counts computed tokens."""
        tables, starts, keep = self._table(seq_id), self._starts[seq_id], self.blocks_for(num_tokens)
        if not 0 <= num_tokens <= self._num_tokens[seq_id]:
            raise ValueError(f"seq {seq_id}: truncate to {num_tokens} of {self._num_tokens[seq_id]} tokens")
        for g, table in enumerate(tables):
            for i in reversed(range(keep, len(table))):
                if i >= starts[g]:  # (entries before a window's start hold nothing)
                    self.pool.decref(table[i])
            del table[keep:]
            starts[g] = min(starts[g], keep)
        self._num_tokens[seq_id] = num_tokens

    def commit(self, seq_id: int, num_computed_tokens: int, tokens: Callable[[int, int], Sequence[int]]) -> None:
        """Cache every block that the first `num_computed_tokens` tokens now fill, then give back
        the sliding groups' blocks that no later query can see. `tokens(start, end)` returns the sequence's token ids [start, end); it is called once per
        newly full block, so calling commit after every step costs O(1) when none became full.
        A block whose key another block already holds stays uncached (and is freed as usual).
        """
        keys = self._keys.get(seq_id)
        if keys is None:
            raise BlockError(f"unknown seq {seq_id}")
        num_full = num_computed_tokens // self.block_size
        if self.enable_prefix_caching and num_full > len(keys):
            if num_computed_tokens > self._num_tokens[seq_id]:
                raise BlockError(f"seq {seq_id}: {num_computed_tokens} computed tokens but room "
                                 f"for {self._num_tokens[seq_id]}")
            self.prefix_cache.fill(self._tables[seq_id], self._tags, keys, num_full, tokens, self.block_size,
                                   self._roots[seq_id])
        if self.state is not None:
            self.state.file(seq_id, num_computed_tokens, keys, self.block_size)
        if self._sliding:
            self._release_window(seq_id, num_computed_tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares all the parent's blocks and has the same token count."""
        tables, starts = self._table(parent_id), self._starts[parent_id]
        self._check_new(child_id)
        for table, start in zip(tables, starts):
            for block_id in table[start:]:
                self.pool.incref(block_id)
        self._tables[child_id] = [list(table) for table in tables]
        self._starts[child_id] = list(starts)
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        self._keys[child_id] = list(self._keys[parent_id])
        self._roots[child_id] = self._roots[parent_id]
        if self.state is not None:
            self.state.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        tables, starts = self._table(seq_id), self._starts[seq_id]
        # NOTE: tail first: with FIFO reuse a sequence's prefix blocks are reused last, and the
        # tail of a cached prefix is evicted before its head (a tail is no use without its head).
        for table, start in zip(tables, starts):
            for block_id in reversed(table[start:]):
                self.pool.decref(block_id)
        for state in (self._tables, self._starts, self._num_tokens, self._keys, self._roots):
            del state[seq_id]
        self.tiers.forget(seq_id)
        if self.state is not None:
            self.state.free(seq_id)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]] | None:
        """Copy a sequence to host blocks and free its device blocks (which the same step may hand
        out again): the (device, host) block pairs to copy first; None if host blocks are short."""
        if not self.can_swap_out(seq_id):
            return None
        tables, starts = self._tables[seq_id], self._starts[seq_id]
        held = [table[start:] for table, start in zip(tables, starts)]
        host_tables = self.host.take(seq_id, held, starts, self._num_tokens[seq_id], self._keys[seq_id],
                                     self._roots[seq_id])
        pairs = [pair for blocks, host in zip(held, host_tables) for pair in zip(blocks, host)]
        if self.state is not None:
            self.state.swap_out(seq_id)
        self.free(seq_id)
        return pairs

    def swap_in(self, seq_id: int, reserve: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped-out sequence back into fresh device blocks (not cached again): the (host,
        device) block pairs to copy after the swap-out pairs; None if short."""
        if not self.can_swap_in(seq_id, reserve):
            return None
        if self.state is not None:
            self.state.swap_in(seq_id)
        swapped = self.host.give_back(seq_id)
        held = [[self._alloc() for _ in host] for host in swapped.host_tables]
        self._tables[seq_id] = [[0] * start + blocks for start, blocks in zip(swapped.starts, held)]
        self._starts[seq_id] = swapped.starts
        self._num_tokens[seq_id] = swapped.num_tokens
        self._keys[seq_id] = swapped.keys
        self._roots[seq_id] = swapped.root
        return [pair for host, blocks in zip(swapped.host_tables, held) for pair in zip(host, blocks)]

    def free_swapped(self, seq_id: int) -> None:
        """Drop a sequence that finished (or was aborted) while swapped out."""
        self.host.give_back(seq_id)
        if self.state is not None:
            self.state.free_swapped(seq_id)

    def check_invariants(self) -> None:
        """Raise BlockError if a block is lost, misfiled or refcounted wrongly, the cache map and
        the blocks' keys disagree, or a host block is lost or held twice. O(blocks)."""
        check_tables(self._tables, self._starts, self._num_tokens, self._keys, self._roots, self.block_size)
        if not self.enable_prefix_caching and (len(self.prefix_cache) or any(self._keys.values())):
            raise BlockError("prefix caching is off but blocks are cached")
        refs = Counter(b for tables, starts in zip(self._tables.values(), self._starts.values())
                       for table, start in zip(tables, starts) for b in table[start:])
        self.pool.check_invariants(refs)  # and the prefix cache's own
        self.host.check_invariants(self._tables.keys(), self.blocks_for, self.block_size)
        self.tiers.check_invariants()
        if self.state is not None:
            self.state.check_invariants(set(self._tables))

    # ---- internals ----

    def _table(self, seq_id: int) -> list[list[int]]:
        try:
            return self._tables[seq_id]
        except KeyError:
            state = " (swapped out)" if seq_id in self.host.swapped else ""
            raise BlockError(f"unknown seq {seq_id}{state}") from None

    def _check_new(self, seq_id: int) -> None:
        if seq_id in self._tables or seq_id in self.host.swapped:
            raise BlockError(f"seq {seq_id} already has a block table")

    def _alloc(self) -> int:
        block_id = self.pool.allocate()
        assert block_id is not None, "caller checked can_allocate"
        return block_id

    def _fits(self, need: int, reserve: int) -> bool:
        """Whether `need` blocks can be taken leaving `reserve` allocatable. Taking none always
        fits: the reserve limits what an allocation takes, not what others left."""
        return need <= 0 or need + reserve <= self.pool.num_free

    def _seat(self) -> bool:
        """Room for one more sequence's state, where the model has state slots."""
        return self.state is None or self.state.can_start()

    def _release_window(self, seq_id: int, computed: int) -> None:
        """Give back each sliding group's blocks before the window of the next query (position
        `computed`), oldest first, so that the pool evicts them before the newer ones."""
        tables, starts = self._tables[seq_id], self._starts[seq_id]
        for g in self._sliding:
            table = tables[g]
            # (the last block stays: it is where the sequence grows, even with a window of 1)
            end = min(first_needed_block(self.windows[g], computed, self.block_size), len(table) - 1)
            for i in range(starts[g], end):
                self.pool.decref(table[i])
                table[i] = 0
            starts[g] = max(starts[g], end)

    def _match(self, token_ids: Sequence[int], max_tokens: int, root: bytes) -> PrefixHit:
        return self.tiers.match(token_ids, max_tokens, root, self.windows, self._tags,
                                self.state.usable_hit if self.state is not None else None)

    def _allocate_plan(self, num_tokens: int, token_ids: Sequence[int] | None, root: bytes = b"") -> tuple[PrefixHit, int]:
        """(the prefix hit to reuse, blocks the allocation takes from the allocatable ones)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        hit = self._match(token_ids, min(len(token_ids) - 1, num_tokens), root) if (
            token_ids is not None and self.enable_prefix_caching) else PrefixHit([[] for _ in self.windows], [], 0)
        return hit, self.tiers.blocks_needed(hit, self.blocks_for(num_tokens), self.windows, self.pool.refcount)

    def _append_need(self, seq_id: int, num_new_tokens: int) -> tuple[int, list[int]]:
        """(blocks to allocate, the groups whose last block needs copy-on-write) for an append."""
        tables = self._table(seq_id)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        n = self._num_tokens[seq_id]
        cow = []
        if num_new_tokens > 0 and n % self.block_size != 0:
            cow = [g for g, (t, s) in enumerate(zip(tables, self._starts[seq_id]))
                   if s < len(t) and self.pool.refcount(t[-1]) > 1]
        need = len(tables) * (self.blocks_for(n + num_new_tokens) - len(tables[0])) + len(cow)
        return need, cow
