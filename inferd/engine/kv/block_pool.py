"""The physical KV blocks as ids: a refcount per block and a free list (no tensors here).

Each of the `num_blocks` blocks is in exactly one state:

    used       refcount > 0, in one or more block tables
    free       refcount 0, on the free list
    evictable  refcount 0, still in the prefix cache (LRU order); allocatable like a free block

    allocate:  free list (oldest freed first)  -->  else evict the least recently freed cached block
    decref to 0:  cached?  yes -> evictable      no -> free list
"""

from __future__ import annotations

from collections import Counter, deque

from inferd.engine.kv.prefix_cache import BlockError, PrefixCache


class BlockPool:
    """`num_blocks` refcounted blocks, and the prefix cache that keeps freed ones evictable."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        # NOTE: FIFO reuse (oldest freed block first) keeps recently freed blocks intact longest;
        # any order is correct.
        self._free: deque[int] = deque(range(num_blocks))
        self.cache = PrefixCache(num_blocks)

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out now: free plus evictable."""
        return len(self._free) + self.cache.num_evictable

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self) -> int | None:
        """A block with refcount 1: from the free list, else the least recently freed evictable."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id = self.cache.evict()
            if block_id is None:
                return None
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
        if rc == 1 and not self.cache.park(block_id):
            self._free.append(block_id)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def register(self, block_id: int, key: bytes) -> bool:
        """File a used block in the prefix cache under `key` (see `PrefixCache.register`)."""
        if self._refcounts[block_id] == 0:
            raise BlockError(f"register of free block {block_id}")
        return self.cache.register(block_id, key)

    def acquire(self, block_id: int) -> None:
        """Take one more reference to a cached block, which may be evictable (refcount 0)."""
        if self.cache.key(block_id) is None:
            raise BlockError(f"acquire of uncached block {block_id}")
        if self._refcounts[block_id] == 0:
            self.cache.unpark(block_id)
        self._refcounts[block_id] += 1

    def check_invariants(self, refs: Counter[int]) -> None:
        """Raise BlockError unless every block's refcount equals `refs` (its references from all
        block tables) and it is in exactly one state, or if the prefix cache is inconsistent. O(blocks)."""
        free = Counter(self._free)
        unknown = [b for b in free if not 0 <= b < self.num_blocks]
        if unknown:
            raise BlockError(f"the free list holds unknown block ids {unknown}")
        cache = self.cache
        for block_id in range(self.num_blocks):
            rc = self._refcounts[block_id]
            on_free = free[block_id]
            evictable = cache.is_evictable(block_id)
            if on_free > 1:
                raise BlockError(f"block {block_id} is {on_free} times on the free list")
            if rc != refs[block_id]:
                raise BlockError(f"block {block_id}: refcount {rc} != {refs[block_id]} references")
            if (rc > 0) + on_free + evictable != 1:
                raise BlockError(f"block {block_id}: refcount {rc}, free {bool(on_free)}, "
                                 f"evictable {evictable}: lost or misfiled")
            if on_free and cache.key(block_id) is not None:
                raise BlockError(f"free block {block_id} is still cached")
        cache.check_invariants()
