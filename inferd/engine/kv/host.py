"""Host blocks for swapped-out sequences (no tensors here): the free list of host block ids and
what each swapped sequence needs to come back. The block manager is its only caller; the copies
themselves are worker/kv_cache.py's."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from inferd.engine.kv.prefix_cache import BlockError


@dataclass(slots=True)
class SwappedSeq:
    """What a swapped-out sequence needs to come back: per KV group, its host blocks in table
    order (the part of the table it held) and where that part starts."""

    host_tables: list[list[int]]
    starts: list[int]
    num_tokens: int
    keys: list[bytes]  # the keys of its full computed blocks, for chaining later commits
    root: bytes  # its prefix-cache namespace

    @property
    def num_blocks(self) -> int:
        return sum(len(host) for host in self.host_tables)


class HostBlocks:
    def __init__(self, num_host_blocks: int) -> None:
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_blocks = num_host_blocks
        self.free: deque[int] = deque(range(num_host_blocks))
        self.swapped: dict[int, SwappedSeq] = {}

    def take(self, seq_id: int, held: list[list[int]], starts: list[int], num_tokens: int, keys: list[bytes],
             root: bytes) -> list[list[int]]:
        """Host blocks for each group's held device blocks (the caller checked there are enough)."""
        host_tables = [[self.free.popleft() for _ in blocks] for blocks in held]
        self.swapped[seq_id] = SwappedSeq(host_tables, list(starts), num_tokens, keys, root)
        return host_tables

    def get(self, seq_id: int) -> SwappedSeq:
        try:
            return self.swapped[seq_id]
        except KeyError:
            raise BlockError(f"seq {seq_id} is not swapped out") from None

    def give_back(self, seq_id: int) -> SwappedSeq:
        """Forget a swapped sequence (back on the device, or ended) and free its host blocks."""
        swapped = self.get(seq_id)
        del self.swapped[seq_id]
        for host in swapped.host_tables:
            self.free.extend(host)
        return swapped

    def check_invariants(self, live: set[int] | object, blocks_for: Callable[[int], int], block_size: int) -> None:
        """Swapped sequences are not live, and each host block is free or held by one of them."""
        both = self.swapped.keys() & live  # type: ignore[operator]
        if both:
            raise BlockError(f"seqs {both} are live and swapped")
        host_refs = Counter(self.free)
        for seq_id, swapped in self.swapped.items():
            for host, start in zip(swapped.host_tables, swapped.starts, strict=True):
                if start + len(host) != blocks_for(swapped.num_tokens):
                    raise BlockError(f"swapped seq {seq_id}: {len(host)} host blocks from {start} "
                                     f"for {swapped.num_tokens} tokens")
                host_refs.update(host)
            if len(swapped.keys) > swapped.num_tokens // block_size:
                raise BlockError(f"swapped seq {seq_id}: {len(swapped.keys)} keys for {swapped.num_tokens} tokens")
        for host_id in range(self.num_blocks):
            if host_refs[host_id] != 1:
                raise BlockError(f"host block {host_id} is held {host_refs[host_id]} times (free or swapped)")
        unknown = [h for h in host_refs if not 0 <= h < self.num_blocks]
        if unknown:
            raise BlockError(f"unknown host block ids {unknown}")
