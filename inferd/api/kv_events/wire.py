"""vLLM's KV-event structures (vllm/distributed/kv_events.py), field for field: the same class
names (msgspec's `tag=True` writes the class name into each event), the same fields in the same
order with the same defaults, and the same struct options, so vLLM's own
`msgspec.msgpack.Decoder(KVEventBatch)` reads inferd's bytes (tests/api/kv_events checks both
against vLLM's source where it is installed).

    batch  [ts, [event, ...], data_parallel_rank]            (array_like: a msgpack array)
    event  {"type": "BlockStored", "block_hashes": [...], ...} (tagged: a map, defaults omitted)

inferd fills what its engine knows (engine/kv/events.py) and leaves the rest at None: no LoRA,
no per-event session, no locality or ownership.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

# a block hash as vLLM types it: bytes (inferd's: 16 bytes), or an int where vLLM is told to
# publish 64-bit integers (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """One change to a replica's KV cache; the tag is the subclass's name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # (vLLM keeps it for old readers; inferd: None)
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block; inferd: (namespace hex,) on block 0
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def from_engine(event: Any) -> KVCacheEvent:
    """An engine event (engine/kv/events.py: the same class names, a part of the fields) as its
    wire structure. (The API reaches the engine through its face only, so by name, not by type.)"""
    kind = type(event).__name__
    if kind == "BlockStored":
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size, None,
                           event.medium, None, event.extra_keys, event.group_idx)
    if kind == "BlockRemoved":
        return BlockRemoved(event.block_hashes, event.medium, event.group_idx)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise TypeError(f"not a KV event: {kind}")


def batch(events: list[KVCacheEvent]) -> KVEventBatch:
    """One step's events (or a cleared cache), stamped now; rank 0 (vLLM's without data parallelism)."""
    return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
