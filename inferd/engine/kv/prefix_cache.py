"""Prefix cache: full computed blocks filed under a hash of their tokens, for reuse by later
prompts that start with the same tokens (no tensors here; the blocks' contents stay in the KV cache).

A block's key hashes its tokens and, through its parent's key, every token before it, so equal keys
mean equal prefixes, not just equal blocks:

    block_size = 4     a: [1 2 3 4 | 5 6 7 8 | 9 .  .  . ]   keys k0 = H(b"", 1234), k1 = H(k0, 5678)
                       b: [1 2 3 4 | 5 6 7 8 | 9 9 .  . ]   match(b) -> blocks of k0, k1
                           ^ same block ^ same block  ^ not full: never cached

A cached block that no sequence holds any more is *evictable*: it keeps its contents until the
pool's free list runs dry, then the least recently freed one is taken and dropped from the cache.

    key -> block      `_cached`, for blocks in use or evictable
    block -> key      `_keys`, None for a block that is not cached
    evictable         `_evictable`, refcount-0 cached blocks, least recently freed first

The allocator's modules, lowest first: retention <- prefix_cache <- block_pool <- block_manager.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from hashlib import blake2b

from typing import TYPE_CHECKING

from inferd.engine.kv.errors import BlockError
from inferd.engine.kv.groups import usable_hit

if TYPE_CHECKING:
    from inferd.engine.kv.events import KVEventRecorder
    from inferd.engine.kv.retention import Retention


def block_key(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: its tokens, chained to every block before it.

    NOTE: a cryptographic hash, not Python's `hash()`: a client can craft prompts whose int tuples
    collide under `hash()`, and a collision hands one tenant another's KV (wrong output, and a
    data leak). `parent_key` is the sequence's namespace for its first block: b"", or the salt
    that keeps one tenant's prefixes from another's (api/admission/door.py).
    """
    return blake2b(parent_key + struct.pack(f"<{len(token_ids)}i", *token_ids), digest_size=16).digest()


class PrefixCache:
    """Which block holds which prefix, and which cached blocks may be evicted, in LRU order.

    It knows nothing of refcounts: the `BlockPool` that owns it calls `park` when a block's last
    reference goes, `unpark` when a cached block is taken again, and `evict` when it runs dry.
    """

    def __init__(self, num_blocks: int) -> None:
        self._keys: list[bytes | None] = [None] * num_blocks  # each block's key, None: uncached
        self._cached: dict[bytes, int] = {}  # key -> block id; used or evictable blocks only
        # refcount-0 cached blocks, least recently freed first (values unused): the anonymous ones;
        # those a session holds wait in `retention` (kv/retention.py), evicted after these
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.retention: Retention | None = None  # (kv/cache_tiers.py sets both)
        self.on_evict: Callable[[int, bytes], None] | None = None  # told of each eviction (block, key)
        self.events: KVEventRecorder | None = None  # [kv_events] on: what is filed and evicted (kv/events.py)

    def __len__(self) -> int:
        """Blocks filed in the cache, used or evictable."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable) + (self.retention.num_parked if self.retention is not None else 0)

    def key(self, block_id: int) -> bytes | None:
        return self._keys[block_id]

    def lookup(self, key: bytes) -> int | None:
        return self._cached.get(key)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable or self.retention is not None and self.retention.is_parked(block_id)

    # ---- hashing and matching ----

    def match(self, token_ids: Sequence[int], max_tokens: int, block_size: int,
              root: bytes = b"", tag: bytes = b"") -> tuple[list[int], list[bytes]]:
        """The cached blocks (and their keys) holding the leading full blocks of `token_ids`, at
        most `max_tokens` tokens' worth, in the namespace `root` (the first block's parent key),
        filed under key + `tag` (a KV group's: kv/groups.py). Changes nothing."""
        bs = block_size
        blocks: list[int] = []
        keys: list[bytes] = []
        parent = root
        for i in range(max(max_tokens, 0) // bs):
            parent = block_key(parent, token_ids[i * bs:(i + 1) * bs])
            block_id = self._cached.get(parent + tag)
            if block_id is None:
                break
            blocks.append(block_id)
            keys.append(parent)
        return blocks, keys

    def chain_keys(self, token_ids: Sequence[int], max_tokens: int, block_size: int, root: bytes = b"") -> list[bytes]:
        """The keys of the leading full blocks of `token_ids`, at most `max_tokens` tokens' worth,
        cached or not."""
        keys: list[bytes] = []
        parent = root
        for i in range(max(max_tokens, 0) // block_size):
            parent = block_key(parent, token_ids[i * block_size:(i + 1) * block_size])
            keys.append(parent)
        return keys

    def fill(self, tables: Sequence[list[int]], tags: Sequence[bytes], keys: list[bytes], num_full: int,
             tokens: Callable[[int, int], Sequence[int]], block_size: int, root: bytes = b"") -> None:
        """File blocks [len(keys), num_full) of a sequence's tables (one per KV group), which the
        caller holds and which are now full and computed, each group's under key + its tag,
        appending their keys to `keys` (the sequence's keys so far, chained on from `root`)."""
        bs, first, events = block_size, len(keys), self.events
        parent = keys[-1] if keys else root
        filed: list[int] = []  # (events on) the blocks newly filed
        for i in range(first, num_full):
            block_tokens = tokens(i * bs, (i + 1) * bs)
            if len(block_tokens) != bs:
                raise ValueError(f"tokens({i * bs}, {(i + 1) * bs}) gave {len(block_tokens)} tokens")
            parent = block_key(parent, block_tokens)
            # NOTE: the key goes on the sequence's list even when register refuses it (another
            # block holds it): the next block's key chains from it either way.
            if self.register(tables[0][i], parent + tags[0]) and events is not None:
                filed.append(i)
            keys.append(parent)
        if events is not None:
            events.stored(keys, filed, tokens, root, 0)
        for group in range(1, len(tables)):  # (the same keys, each group's blocks)
            table, tag = tables[group], tags[group]
            filed = [i for i in range(first, num_full) if self.register(table[i], keys[i] + tag)]
            if events is not None:
                events.stored(keys, filed, tokens, root, group)

    def register(self, block_id: int, key: bytes) -> bool:
        """File a block the caller holds under `key`; False (and nothing changes) if the key is
        taken or the block already has a key. `BlockPool.register` checks that it is held."""
        if key in self._cached or self._keys[block_id] is not None:
            return False
        self._cached[key] = block_id
        self._keys[block_id] = key
        return True

    # ---- eviction (the pool calls these) ----

    def park(self, block_id: int) -> bool:
        """A block lost its last reference: keep it as evictable if cached (True); False if it is
        not cached, and then the pool frees it."""
        key = self._keys[block_id]
        if key is None:
            return False
        if self.retention is None or not self.retention.park(block_id, key):
            self._evictable[block_id] = None  # at the LRU end
        return True

    def unpark(self, block_id: int) -> None:
        """An evictable block is referenced again (a prefix hit): no longer evictable."""
        if block_id in self._evictable:
            del self._evictable[block_id]
        else:  # (a session's)
            self.retention.unpark(block_id)  # type: ignore[union-attr]

    def evict(self) -> int | None:
        """Drop the least recently freed evictable block from the cache and return it (anonymous
        blocks first, then sessions': kv/retention.py); None if none."""
        if self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
        elif self.retention is None or (block_id := self.retention.victim()) is None:  # type: ignore[assignment]
            return None
        key: bytes = self._keys[block_id]  # type: ignore[assignment]
        if self.events is not None:
            self.events.removed(key)
        if self.on_evict is not None:
            self.on_evict(block_id, key)
        del self._cached[key]
        self._keys[block_id] = None
        return block_id

    def requeue(self, block_id: int) -> None:
        """A parked block that no session holds any more: anonymous again (the LRU's recent end)."""
        self._evictable[block_id] = None

    def rehome(self, keys: list[bytes]) -> None:
        """Blocks under these keys that wait anonymous move to the sessions now holding them."""
        for key in keys:
            block_id = self._cached.get(key)
            if block_id is not None and block_id in self._evictable:
                del self._evictable[block_id]
                self.park(block_id)

    def check_invariants(self) -> None:
        """Raise BlockError if the key map and the blocks' keys disagree, or an evictable block is
        not cached. O(blocks). (Whether evictable blocks are unreferenced is the pool's check.)"""
        num_blocks = len(self._keys)
        if self.retention is not None:
            self.retention.check_invariants()
            both = [b for b in self._evictable if self.retention.is_parked(b)]
            if both:
                raise BlockError(f"blocks {both} are both anonymous and a session's")
        for block_id in self._evictable:
            if not 0 <= block_id < num_blocks:
                raise BlockError(f"the evictable list holds unknown block id {block_id}")
            if self._keys[block_id] is None:
                raise BlockError(f"evictable block {block_id} is not cached")
        for block_id, key in enumerate(self._keys):
            if key is not None and self._cached.get(key) != block_id:
                raise BlockError(f"block {block_id}: its key maps to {self._cached.get(key)}")
        for key, block_id in self._cached.items():
            if not 0 <= block_id < num_blocks or self._keys[block_id] != key:
                raise BlockError(f"cache maps a key to block {block_id}, which has another key")


def match_groups(cache: PrefixCache, token_ids: Sequence[int], max_tokens: int, block_size: int, root: bytes,
                 windows: Sequence[int | None], tags: Sequence[bytes], resumable: Callable[[list[bytes]], int] | None = None,
                 ) -> tuple[list[list[int | None]], list[bytes], int]:
    """Per KV group, the cached blocks of the longest usable prefix hit (full groups: all of it;
    sliding groups: its window's, None before), the hit's keys, and how many blocks the KV groups
    alone would reuse. A group's blocks are filed under key + its tag (kv/groups.py).
    `resumable` (a hybrid model's state slots): of a hit's keys, how many lead to a state
    checkpoint; the hit is cut there (the linear layers' state exists at checkpoints only)."""
    if windows[0] is None:  # (full groups come first: they bound the hit, stopping early)
        blocks, keys = cache.match(token_ids, max_tokens, block_size, root)
    else:
        keys = cache.chain_keys(token_ids, max_tokens, block_size, root)
    if len(windows) == 1 and windows[0] is None:
        found: list[list[int | None]] = [list(blocks)]
        num_hit = len(keys)
    else:
        found = [[cache.lookup(key + tag) for key in keys] for tag in tags]
        num_hit = usable_hit(found, windows, block_size)
    usable = num_hit if resumable is None else resumable(keys[:num_hit])
    return [blocks[:usable] for blocks in found], keys[:usable], num_hit


def check_tables(tables: Mapping[int, list[list[int]]], starts: Mapping[int, list[int]], num_tokens: Mapping[int, int],
                 keys: Mapping[int, list[bytes]], roots: Mapping[int, bytes], block_size: int) -> None:
    """Raise BlockError where the block manager's per-sequence state disagrees with itself: the
    sequences with tables, starts, counts, keys and roots differ, a table's length is not its
    token count's, or a sequence has keys for more full blocks than it has."""
    if not (keys.keys() == roots.keys() == starts.keys() == tables.keys() == num_tokens.keys()):
        raise BlockError("sequences with keys and with tables differ")
    for seq_id, seq_tables in tables.items():
        n = num_tokens[seq_id]
        for table, start in zip(seq_tables, starts[seq_id], strict=True):
            if len(table) != -(-n // block_size) or not 0 <= start <= len(table):
                raise BlockError(f"seq {seq_id}: {len(table)} blocks from {start} for {n} tokens")
        if len(keys[seq_id]) > n // block_size:
            raise BlockError(f"seq {seq_id}: {len(keys[seq_id])} keys for {n} tokens")
