"""The prefix cache's host-memory tier (no tensors here; worker/kv_cache.py copies the blocks).

A cached block evicted from the KV cache is copied to a host block under its key instead of being
lost; a later prompt whose prefix runs on past the KV cache's hit into the tier gets fresh blocks
that are copied back before the step's forward, and counts them as cached:

    KV cache full, block k evicted  ->  offload (device k -> host h), key filed under h
    prompt matches key past the KV cache's hit  ->  onload (host h -> fresh device d), d filed under the key

The tier keeps its copy after an onload (the block may be evicted again: no second copy), and is
bounded: when it is full, the least recently used entry goes, entries never reused first (two LRU
lists: a block that has been hit at least once is "protected", any other on "probation"; a scan
of one-time prompts passes through probation without flushing the prefixes that get reused).

Each step's copies run in one order, before anything else writes the KV cache: all offloads, then
all onloads. So an offload reads its device block before an onload (or the forward) reuses it, and
the host blocks that this step's onloads read are pinned: no offload of the same step takes them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from inferd.engine.kv.errors import BlockError


@dataclass
class TierStats:
    offloaded_blocks: int = 0  # copied to the tier on eviction
    onloaded_blocks: int = 0  # copied back on a hit
    dropped_blocks: int = 0  # evicted from the KV cache with no room in the tier (all pinned)
    evicted_blocks: int = 0  # entries the tier itself let go for room


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._probation: OrderedDict[bytes, int] = OrderedDict()  # key -> host block, least recent first
        self._protected: OrderedDict[bytes, int] = OrderedDict()
        self._pinned: set[int] = set()
        self._offloads: list[tuple[int, int]] = []  # this step's (device block, host block)
        self._onloads: list[tuple[int, int]] = []  # this step's (host block, device block)
        self.stats = TierStats()
        self.on_drop: Callable[[bytes], None] | None = None  # told of each entry let go for room (its key)

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key: bytes) -> bool:
        return key in self._protected or key in self._probation

    def offload(self, device_block: int, key: bytes, reused: bool) -> bool:
        """The KV cache evicts `device_block`, filed under `key`: keep a copy (unless one is here).
        `reused`: the block served a prefix hit (it starts protected). True: a copy is taken now."""
        if key in self._protected:
            self._protected.move_to_end(key)
            return False
        if key in self._probation:
            if reused:
                self._protected[key] = self._probation.pop(key)
            return False
        host = self._take()
        if host is None:
            self.stats.dropped_blocks += 1
            return False
        (self._protected if reused else self._probation)[key] = host
        self._offloads.append((device_block, host))
        self.stats.offloaded_blocks += 1
        return True

    def pin(self, keys: list[bytes]) -> None:
        """Keep these entries until the step's copies are taken (an onload of them follows)."""
        for key in keys:
            self._pinned.add(self._protected[key] if key in self._protected else self._probation[key])

    def onload(self, key: bytes, device_block: int) -> None:
        """A prompt reuses the tier's block under `key` (`key in tier`): copy it into `device_block`."""
        host = self._probation.pop(key, None)
        if host is None:
            host = self._protected.pop(key)
        self._protected[key] = host  # (reused: protected, most recent)
        self._pinned.add(host)
        self._onloads.append((host, device_block))
        self.stats.onloaded_blocks += 1

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (offloads, onloads), to run in that order; the step's pins end."""
        copies = self._offloads, self._onloads
        self._offloads, self._onloads = [], []
        self._pinned.clear()
        return copies

    def _take(self) -> int | None:
        """A host block for a new entry: a free one, else the least recently used unpinned entry's
        (probation first)."""
        if self._free:
            return self._free.popleft()
        for entries in (self._probation, self._protected):
            for key, host in entries.items():
                if host not in self._pinned:
                    del entries[key]
                    self.stats.evicted_blocks += 1
                    if self.on_drop is not None:
                        self.on_drop(key)
                    return host
        return None

    def check_invariants(self) -> None:
        held = list(self._free) + list(self._probation.values()) + list(self._protected.values())
        if sorted(held) != list(range(self.num_blocks)):
            raise BlockError("host tier blocks lost or held twice")
        if self._probation.keys() & self._protected.keys():
            raise BlockError("a key on both of the host tier's lists")
