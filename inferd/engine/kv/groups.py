"""KV groups: which layers share a block table, and how much of a sequence a sliding group keeps
(no tensors here; worker/kv_cache.py lays the tensors out by this).

A model with only full-attention layers (Llama) has one group: every block id covers all layers,
as it always did. A hybrid model (Gemma 2/3) splits its layers into groups of `group_size` layers
each, one kind per group, and every group has its own block table per sequence. All groups draw
from one pool: a block id is `group_size` layers' worth of K/V, and which group holds it decides
which layers' data it is (vLLM's hybrid allocator, in spirit).

    Gemma 3 shaped, 12 layers (5 sliding : 1 full)  ->  group_size 2, six groups
    full:     layers 5, 11                               group 0   (window None)
    sliding:  0, 1 | 2, 3 | 4, 6 | 7, 8 | 9, 10          groups 1-5 (window W)

A linear-attention layer (Qwen3.5's Gated DeltaNet) holds no blocks either: its cache is one
state slot per sequence (kv/state_slots.py), so the layout lists it in `linear`, in no group:
the cache groups are the attention groups plus, where there are linear layers, the state slots.

Layers whose K/V differ in shape (Gemma 4's full layers: their own head size and KV heads) never
share a group, and a layer that reads another layer's cache (Gemma 4's KV sharing) is in none: it
holds no block, and its place is its source's.

A sliding group holds only the blocks that cover its window. A query at position p sees keys
(p - W, p], so once `computed` tokens are in the cache every later query needs blocks from
`first_needed_block(W, computed)` on; the entries before that point at no block of the sequence
(the runner sends block 0 there; the kernels skip them, the reference masks them):

    block_size 4, W = 6, 14 computed   positions  0..3 | 4..7 | 8..11 | 12..15
    full group table                              7    | 2    | 5     | 9
    sliding group table                           0    | 0    | 4     | 8     first_needed = 2: the
                                                                             query at 14 sees 9..14
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


def first_needed_block(window: int | None, computed: int, block_size: int) -> int:
    """The first block a query at position `computed` (or later) can see: 0 for full attention."""
    if window is None:
        return 0
    return max(0, computed - window + 1) // block_size


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # None: full attention
    layers: tuple[int, ...]  # at most the layout's group_size; slot i of a block is layers[i]'s
    shape: Hashable = None  # its layers' K/V shape where layers differ (worker/kv_cache.py's); None: the model's


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    group_size: int  # layers per block id: the KV tensor's first dimension
    sources: tuple[int, ...] = ()  # per layer, the layer whose cache it reads; (): each its own
    linear: tuple[int, ...] = ()  # linear-attention layers: a state slot each, no blocks

    @classmethod
    def for_layers(cls, windows: Sequence[int | None], shapes: Sequence[Hashable] | None = None,
                   sources: Sequence[int] | None = None, linear: Sequence[int] = ()) -> KVLayout:
        """Group layers by their window (None: full), and by `shapes` where given. One kind: one
        group of every layer (the layout every model had before). Several: groups as large as the
        rarest kind, so no group wastes more than a few slots; full groups first. A layer whose
        `sources` entry is another layer holds no place of its own."""
        if not windows:
            raise ValueError("a model with no layers")
        own = [i for i in range(len(windows)) if (sources is None or sources[i] == i) and i not in linear]
        kind_of = {i: (windows[i], None if shapes is None else shapes[i]) for i in own}
        kinds = sorted(set(kind_of.values()), key=lambda k: (k[0] is not None, k[0] or 0, str(k[1])))
        by_kind = [tuple(i for i in own if kind_of[i] == kind) for kind in kinds]
        size = min(len(layers) for layers in by_kind)
        groups = tuple(KVGroup(window, layers[i:i + size], shape)
                       for (window, shape), layers in zip(kinds, by_kind) for i in range(0, len(layers), size))
        return cls(groups, size, tuple(sources) if sources is not None else (), tuple(linear))

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def num_layers(self) -> int:
        return len(self.sources) if self.sources else sum(len(g.layers) for g in self.groups) + len(self.linear)

    def placement(self) -> list[tuple[int, int]]:
        """Per layer, its (group, slot in the block): a KV-shared layer's is its source's; a
        linear-attention layer's is (0, 0), unused (its cache is a state slot)."""
        places = [(0, 0)] * self.num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                places[layer] = (g, slot)
        return [places[source] for source in self.sources] if self.sources else places

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Blocks a sequence of `num_tokens` holds at most, when it computes up to `chunk` tokens
        a step (a sliding group needs its window behind the chunk's first token)."""
        blocks = -(-num_tokens // block_size)
        total = 0
        for window in self.windows:
            if window is None:
                total += blocks
            else:  # (+1: the window's first block may be cut, +1: released at block ends only)
                total += min(blocks, -(-(window + chunk) // block_size) + 2)
        return total

    def max_tokens(self, num_blocks: int, block_size: int, chunk: int) -> int:
        """The longest sequence `num_blocks` blocks hold (blocks_held), by bisection."""
        lo, hi = 0, num_blocks * block_size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_held(mid, block_size, chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


def usable_hit(found: Sequence[Sequence[int | None]], windows: Sequence[int | None], block_size: int) -> int:
    """How many leading blocks of a prompt a prefix hit may reuse, given per group the cached
    block (or None) of each leading block: the most h such that every full group has blocks
    [0, h) and every sliding group the blocks of the window at h, [first_needed_block(h), h)."""
    limit = min(len(f) for f in found)
    ok = [True] * (limit + 1)  # ok[h]: every group so far can serve a hit of h blocks
    for blocks, window in zip(found, windows):
        run = 0  # cached blocks in a row, ending at block h - 1
        for h in range(1, limit + 1):
            run = run + 1 if blocks[h - 1] is not None else 0
            ok[h] = ok[h] and run >= h - first_needed_block(window, h * block_size, block_size)
    return max(h for h in range(limit + 1) if ok[h])
