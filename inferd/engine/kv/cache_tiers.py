"""Where a prompt's cached prefix comes from, and why it is not longer (no tensors here): the KV
cache's blocks first, then the host tier's (kv/host_tier.py), with sessions' prefixes held
ahead of anonymous ones (kv/retention.py). The block manager owns one `CacheTiers` and asks it to
match a prompt, to report a prompt's hit, and to retain a session's state when a request ends.

    prompt  [ KV cache hit | host tier hit | computed ...             ]
             acquired       fresh blocks, copied back before the step

Why a prompt missed (`PrefixReport.miss`, in each request's usage and log line), for the first
block the cache did not supply:
    "diverged at token N"       its session's previous state differs from the prompt at token N
    "evicted"                   its block was cached (in its session's state, or recently), and
                                was evicted (and is not in the host tier)
    "another tenant's namespace"  its first block is cached, under another tenant's salt
    "diverged within tokens A-B"  cached prompts share the blocks before it, not this one
    "cold"                      nothing cached shares its first block
A session's prompt that brings all of its previous state back is a full hit (the rest is new).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inferd.engine.kv.events import CPU, GPU, KVEventRecorder
from inferd.engine.kv.groups import first_needed_block
from inferd.engine.kv.host_tier import HostTier
from inferd.engine.kv.prefix_cache import PrefixCache, block_key, match_groups
from inferd.engine.kv.retention import Retention
from inferd.engine.kv.state_slots import StateSlots
from inferd.engine.protocol import CacheTiersSnapshot, Session

RECENT_EVICTIONS_PER_BLOCK = 4  # evicted keys remembered (to say "evicted"), per block of the pool
FIRST_BLOCKS = 4096  # prompts' first blocks remembered with their namespace (to say "another tenant's")


@dataclass
class PrefixHit:
    """What a prompt can reuse: per KV group the KV cache's blocks (None where the host tier
    supplies the block, or before a sliding window), the hit's keys, how many blocks the KV
    groups alone would reuse (prefix_cache.match_groups), and the host tier's part."""

    blocks: list[list[int | None]]
    keys: list[bytes]
    attention_hit: int
    from_host: int = 0


@dataclass(frozen=True)
class PrefixReport:
    cached_tokens: int  # of the prompt, served from cache (both tiers)
    host_tokens: int  # of which the host tier supplied
    miss: str | None  # why not more (the module's words); None: every cacheable block was a hit


class CacheTiers:
    def __init__(self, cache: PrefixCache, num_blocks: int, block_size: int, host_blocks: int,
                 clock: Callable[[], float], session_share: float, state: StateSlots | None = None,
                 events: KVEventRecorder | None = None) -> None:
        self.cache = cache
        self.block_size = block_size
        self.host = HostTier(host_blocks) if host_blocks else None
        self.retention = Retention(clock, lambda tenant: num_blocks if tenant is None else int(session_share * num_blocks),
                                   cache.requeue, cache.key)
        cache.retention = self.retention
        if state is not None:  # (a hybrid model's checkpoints: those a session holds are evicted last)
            state.held = self.retention.holds
        cache.on_evict = self._evicted
        self.events = cache.events = events  # (None: [kv_events] off)
        if events is not None and self.host is not None:
            events.track()  # (a block's moves between the tiers are published with its parent and tokens)
            self.host.on_drop = self._dropped
        self._reused = bytearray(num_blocks)  # per block: it served a prefix hit since it was cached
        self._recent_evictions: OrderedDict[bytes, None] = OrderedDict()
        self._max_recent = RECENT_EVICTIONS_PER_BLOCK * num_blocks
        self._first_blocks: OrderedDict[bytes, bytes] = OrderedDict()  # unsalted key -> the namespace it was cached in
        self._hits: dict[int, tuple[int, int]] = {}  # seq -> (blocks hit, of which from the host tier), until reported
        self.host_hit_tokens = 0

    # ---- matching ----

    def match(self, token_ids: Sequence[int], max_tokens: int, root: bytes, windows: Sequence[int | None],
              tags: Sequence[bytes], resumable: Callable[[list[bytes]], int] | None) -> PrefixHit:
        """The longest reusable prefix (match_groups), continued into the host tier where the model
        has one full-attention group and no state (then a block may come from either tier)."""
        blocks, keys, attention_hit = match_groups(self.cache, token_ids, max_tokens, self.block_size, root, windows,
                                                   tags, resumable)
        hit = PrefixHit(blocks, keys, attention_hit)
        if self.host is None or len(windows) > 1 or windows[0] is not None or resumable is not None:
            return hit
        bs, parent = self.block_size, keys[-1] if keys else root
        for i in range(len(keys), max(max_tokens, 0) // bs):
            parent = block_key(parent, token_ids[i * bs:(i + 1) * bs])
            block_id = self.cache.lookup(parent)
            if block_id is None and parent not in self.host:
                break
            hit.blocks[0].append(block_id)
            hit.from_host += block_id is None
            hit.keys.append(parent)
        hit.attention_hit = len(hit.keys)
        return hit

    def blocks_needed(self, hit: PrefixHit, num_blocks: int, windows: Sequence[int | None],
                      refcount: Callable[[int], int]) -> int:
        """Blocks an allocation of `num_blocks` per group with `hit` takes from the allocatable
        ones: fresh blocks (the host tier's entries among them), and reused blocks that were evictable."""
        bs = self.block_size
        need = len(windows) * (num_blocks - len(hit.keys)) + hit.from_host
        for blocks, window in zip(hit.blocks, windows):
            reused = blocks[first_needed_block(window, len(hit.keys) * bs, bs):]
            need += sum(b is not None and refcount(b) == 0 for b in reused)
        return need

    def onload(self, hit: PrefixHit, alloc: Callable[[], int], register: Callable[[int, bytes], object]) -> None:
        """Fresh blocks for the hit's entries the host tier supplies (one full group), filed under
        their keys; their contents are copied back before the step's forward."""
        host, blocks = self.host, hit.blocks[0]
        assert host is not None
        host.pin([key for key, block_id in zip(hit.keys, blocks) if block_id is None])  # (no eviction below takes them)
        for i, block_id in enumerate(blocks):
            if block_id is None:
                blocks[i] = fresh = alloc()
                register(fresh, hit.keys[i])
                host.onload(hit.keys[i], fresh)
                if self.events is not None:
                    self.events.moved(hit.keys[i], GPU)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's host-tier copies: (offloads (device, host), onloads (host, device)), in that order."""
        return self.host.take_copies() if self.host is not None else ([], [])

    def note_hit(self, seq_id: int, hit: PrefixHit, device_blocks: Sequence[int]) -> None:
        """A prompt's allocation took `hit` (`device_blocks`: its KV cache blocks, now held)."""
        for block_id in device_blocks:
            self._reused[block_id] = 1
        self._hits[seq_id] = (len(hit.keys), hit.from_host)
        self.host_hit_tokens += hit.from_host * self.block_size

    def report(self, seq_id: int, token_ids: Sequence[int] | None, root: bytes, session: Session | None) -> PrefixReport:
        """A prompt's first admission: how much was cached, where from, and why not more."""
        blocks, from_host = self._hits.pop(seq_id, (0, 0))
        bs = self.block_size
        if token_ids is None:
            return PrefixReport(blocks * bs, from_host * bs, None)
        cacheable = (len(token_ids) - 1) // bs
        miss = None if blocks >= cacheable else self._why(token_ids, blocks, root, session)
        if cacheable:
            self._note_first_block(token_ids[:bs], root)
        return PrefixReport(blocks * bs, from_host * bs, miss)

    def forget(self, seq_id: int) -> None:
        self._hits.pop(seq_id, None)

    # ---- sessions ----

    def retain(self, session: Session, tenant: str | None, keys: Sequence[bytes], tags: Sequence[bytes],
               tokens: Sequence[int]) -> None:
        """A request of `session` ended with `keys` (its full computed blocks' keys): hold them
        (with each KV group's tag), and pull those that wait anonymous into the session."""
        tagged = [key + tag for key in keys for tag in tags]
        self.retention.retain(session, tenant, tagged, tokens)
        self.cache.rehome(tagged)

    # ---- internals ----

    def _note_first_block(self, tokens: Sequence[int], root: bytes) -> None:
        """A prompt with this first block was admitted in namespace `root` (its blocks get cached there)."""
        unsalted = block_key(b"", tokens)
        self._first_blocks[unsalted] = root
        self._first_blocks.move_to_end(unsalted)
        if len(self._first_blocks) > FIRST_BLOCKS:
            self._first_blocks.popitem(last=False)

    def _evicted(self, block_id: int, key: bytes) -> None:
        """The KV cache drops `block_id` (filed under `key`): remember it, and keep a copy in the
        host tier if there is one."""
        self._recent_evictions[key] = None
        if len(self._recent_evictions) > self._max_recent:
            self._recent_evictions.popitem(last=False)
        events = self.events
        if self.host is not None:
            if self.host.offload(block_id, key, bool(self._reused[block_id])) and events is not None:
                events.moved(key, CPU)
            elif events is not None and key not in self.host:
                events.forget(key)
        self._reused[block_id] = 0

    def _dropped(self, key: bytes) -> None:
        """(events on) The host tier let the entry under `key` go for room."""
        events = self.events
        assert events is not None
        events.removed(key, CPU)
        if self.cache.lookup(key) is None:
            events.forget(key)

    def _why(self, token_ids: Sequence[int], hit: int, root: bytes, session: Session | None) -> str | None:
        bs = self.block_size
        start, end = hit * bs, (hit + 1) * bs
        held = self.retention.session(session.key) if session is not None else None
        if held is not None:  # (exact: its previous state's tokens are kept)
            state = len(held.tokens)
            same = next((t for t, (a, b) in enumerate(zip(held.tokens, token_ids)) if a != b), min(state, len(token_ids)))
            if same < min(state, end):
                return f"diverged at token {same}"
            if same == state and hit >= state // bs:
                return None  # all of its previous state came back: the rest is new
            return "evicted"
        parent = root
        for i in range(hit + 1):
            parent = block_key(parent, token_ids[i * bs:(i + 1) * bs])
        if parent in self._recent_evictions:
            return "evicted"
        if hit == 0:
            cached_in = self._first_blocks.get(block_key(b"", token_ids[:bs]))
            return "another tenant's namespace" if cached_in is not None and cached_in != root else "cold"
        return f"diverged within tokens {start}-{end - 1}"

    def snapshot(self) -> CacheTiersSnapshot:
        host, retention = self.host, self.retention
        stats = host.stats if host is not None else None
        return CacheTiersSnapshot(
            host.num_blocks if host else 0, len(host) if host else 0, self.host_hit_tokens,
            stats.offloaded_blocks if stats else 0, stats.onloaded_blocks if stats else 0,
            stats.dropped_blocks if stats else 0, len(retention.sessions), retention.num_held_keys,
            retention.released_blocks)

    def check_invariants(self) -> None:
        self.retention.check_invariants()
        if self.host is not None:
            self.host.check_invariants()
