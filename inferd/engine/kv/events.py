"""KV-cache events: what the prefix cache filed and dropped, for cache-aware routers (no tensors,
no wire format here: api/kv_events/ numbers, encodes and publishes them in vLLM's).

The block manager owns a `KVEventRecorder` only when [kv_events] is on (None otherwise: the
prefix cache then pays one `is None` test per fill and per eviction). The engine hands each
step's events out on `StepOutputs.kv_events`.

    prefix cache files blocks 2..4 of a sequence   BlockStored([k2, k3, k4], parent=k1, tokens 8..19)
    ... block 3's key was already filed elsewhere   BlockStored([k2], k1, ...), BlockStored([k4], k3, ...)
    prefix cache evicts a block                     BlockRemoved([k], "GPU")
    host tier keeps a copy of it (kv/host_tier.py)  BlockStored([k], parent, tokens, medium="CPU")
    host tier lets it go                            BlockRemoved([k], "CPU")
    a prompt's hit copies it back                   BlockStored([k], parent, tokens, medium="GPU")

A block's hash is its prefix-cache key, `prefix_cache.block_key`: blake2b(parent key || the
block's token ids as int32 little-endian, digest_size=16), the first block's parent being the
sequence's namespace (b"", or the 16-byte tenant / cache_salt namespace of api/admission/door.py).
A KV group's blocks are filed under key + the group's tag (kv/groups.py): events carry the key
alone and the group's index. The class names and field names are those of vLLM's wire structures
(vllm/distributed/kv_events.py), of which these carry the part inferd fills.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

GPU = "GPU"  # the engine's KV block pool, whatever the device (vLLM's CPU build says "GPU" too)
CPU = "CPU"  # the prefix cache's host tier
KEY_BYTES = 16  # a block key's digest size; the bytes after it are a KV group's tag


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[bytes]  # a run of consecutive blocks of one sequence, each chained to the one before
    parent_block_hash: bytes | None  # the key of the block before the run; None: the run starts the sequence
    token_ids: list[int]  # the run's tokens; [] in a namespace unless [kv_events] tenant_token_ids
    block_size: int
    medium: str  # GPU or CPU
    extra_keys: list[tuple[str, ...] | None] | None = None  # per block: (namespace hex,) on block 0 of a namespace
    group_idx: int = 0  # the KV group


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str
    group_idx: int = 0


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class _Filed:
    """What a filed block's BlockStored said, kept (with a host tier only) to say it again when
    the block moves between the tiers."""

    parent: bytes | None
    token_ids: tuple[int, ...]
    root: bytes
    first: bool  # block 0 of its sequence


def split_key(key: bytes) -> tuple[bytes, int]:
    """(block hash, KV group index) of a prefix-cache key, which may carry a group's tag."""
    return key[:KEY_BYTES], key[KEY_BYTES] if len(key) > KEY_BYTES else 0


class KVEventRecorder:
    """Collects the events of one engine step; `take` hands them over."""

    def __init__(self, block_size: int, tenant_token_ids: bool = False) -> None:
        self.block_size = block_size
        self.tenant_token_ids = tenant_token_ids
        self._events: list[KVEvent] = []
        # key -> what its BlockStored said, for blocks filed on the device or in the host tier:
        # kept only where a host tier exists (`track`), which needs it to publish a block's moves
        self._filed: dict[bytes, _Filed] | None = None

    def track(self) -> None:
        """Remember every filed block's parent and tokens (a host tier is on)."""
        self._filed = {}

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def stored(self, keys: Sequence[bytes], filed: Sequence[int], tokens: Callable[[int, int], Sequence[int]],
               root: bytes, group: int) -> None:
        """Blocks keys[i], i in `filed` (ascending), of a sequence in namespace `root` were newly
        filed in KV group `group`: a BlockStored per run of consecutive ones. `tokens(start, end)`:
        the sequence's token ids."""
        bs = self.block_size
        for start, end in _runs(filed):
            run_tokens = list(tokens(start * bs, end * bs))
            self._store(list(keys[start:end]), keys[start - 1] if start else None, run_tokens, root, start == 0,
                        group, GPU)
            if self._filed is not None:
                for i in range(start, end):
                    self._filed[keys[i] + _tag(group)] = _Filed(keys[i - 1] if i else None, tuple(
                        run_tokens[(i - start) * bs:(i - start + 1) * bs]), root, i == 0)

    def removed(self, key: bytes, medium: str = GPU) -> None:
        """The block under `key` left `medium`; consecutive removals share one event."""
        block_hash, group = split_key(key)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium and last.group_idx == group:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash], medium, group))

    def moved(self, key: bytes, medium: str) -> None:
        """A block already filed (known here) is now held in `medium` too: the host tier took a
        copy (CPU), or a prompt's hit copied it back (GPU)."""
        filed = self._filed[key] if self._filed is not None else None
        if filed is None:  # (never filed while events were on)
            return
        block_hash, group = split_key(key)
        self._store([block_hash], filed.parent, list(filed.token_ids), filed.root, filed.first, group, medium)

    def forget(self, key: bytes) -> None:
        """The block under `key` is in neither tier any more."""
        if self._filed is not None:
            self._filed.pop(key, None)

    def _store(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], root: bytes, first: bool,
               group: int, medium: str) -> None:
        extra_keys = None
        if root:  # (vLLM publishes a request's cache_salt as the first block's extra key)
            extra_keys = [(root.hex(),) if first and i == 0 else None for i in range(len(hashes))]
            if not self.tenant_token_ids:
                token_ids = []
        self._events.append(BlockStored(hashes, parent, token_ids, self.block_size, medium, extra_keys, group))


def _tag(group: int) -> bytes:
    """A KV group's tag on its keys (kv/block_manager.py's `_tags`)."""
    return bytes([group]) if group else b""


def _runs(indexes: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive ascending indexes."""
    runs: list[tuple[int, int]] = []
    for i in indexes:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
