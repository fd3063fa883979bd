"""Recurrent-state slots: the linear-attention layers' cache (no tensors here; worker/kv_cache.py
holds them). A hybrid model (Qwen3.5, Qwen3-Next) has two kinds of cache group: attention
layers' blocks (block_pool.py) and linear layers' state slots, one slot spanning every linear
layer, as a block spans its group's layers.

A slot is in one of four states:

    free         on the free list
    working      a live sequence's state, updated in place by every step it runs
    pending      a checkpoint being written: the forward copies a sequence's state into it after
                 a given row (kernels/linear_attention.py's saves); filed by `file` after the step
    checkpoint   the state after a full block, filed under that block's chained key (the same
                 key the attention blocks are filed under, prefix_cache.block_key), so a prompt
                 whose leading blocks hit resumes from the state at the end of the longest hit
                 that has a checkpoint; least recently used first to be evicted (those a
                 session holds last: kv/retention.py)

Checkpoints are never read in place: a hit copies one into the sequence's working slot. Which
block ends get one (the scheduler asks `plan_saves` for each chunk): the last block end of every
prefill chunk (so the last full block of every prompt), the block end where a new prompt's cached
attention blocks outrun the deepest checkpoint (a branch point: the next prompt that shares this
prefix resumes there), and every block end during decode, of which each sequence keeps only its
last two (a next turn that re-tokenizes the answer's last block differently resumes from the
block before it).

The copies this implies (hit -> working, fork, swap out/in) are queued in `ops` in the order
they were decided and run before the step's forward in that order, so a slot freed and reused
within one schedule() is read before it is overwritten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from inferd.engine.kv.prefix_cache import BlockError
from inferd.engine.protocol import StateSlotsSnapshot

# per sequence, the decode checkpoints kept (older ones are dropped as new ones are filed)
DECODE_CHECKPOINTS = 2


@dataclass
class StateStats:
    """Counters for /metrics and /v1/status."""

    checkpoints_filed: int = 0
    checkpoint_hits: int = 0  # allocations that resumed from a checkpoint
    checkpoint_hit_tokens: int = 0  # prompt tokens those resumed past
    evictions: int = 0  # checkpoints evicted for room (dropped decode checkpoints not counted)


@dataclass
class SeqState:
    working: int  # the sequence's slot
    # (block end in tokens, slot, by a decode row) being written
    pending: list[tuple[int, int, bool]] = field(default_factory=list)
    wanted: set[int] = field(default_factory=set)  # block ends to save when a chunk reaches them (branch points)
    decode_keys: list[bytes] = field(default_factory=list)  # its decode checkpoints, oldest first


class StateSlots:
    """The state-slot pool of a hybrid model; owned and driven by the BlockManager."""

    def __init__(self, num_slots: int, num_host_slots: int = 0, max_live: int = 1) -> None:
        if num_slots < 1:
            raise ValueError("the state pool has room for no slot: raise kv_cache_memory")
        self.num_slots = num_slots
        self.max_live = max_live  # working slots the scheduler may ask for at once (max_num_seqs)
        self._free = list(range(num_slots - 1, -1, -1))  # (a stack: the lowest ids first)
        self._seqs: dict[int, SeqState] = {}
        self._checkpoints: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._key_of: dict[int, bytes] = {}  # checkpoint slot -> key
        self._host_free = list(range(num_host_slots - 1, -1, -1))
        self.num_host_slots = num_host_slots
        self._swapped: dict[int, int] = {}  # seq -> host slot
        # ("copy", src, dst), ("out", slot, host), ("in", host, slot): run in order before the forward
        self.ops: list[tuple[str, int, int]] = []
        self.stats = StateStats()
        # whether a session holds a key (kv/retention.py): its checkpoint is evicted after the others
        self.held: Callable[[bytes], bool] = lambda key: False

    # ---- queries ----

    @property
    def num_free(self) -> int:
        """Slots allocatable now: free plus checkpoints (evictable)."""
        return len(self._free) + len(self._checkpoints)

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)

    @property
    def num_working(self) -> int:
        return len(self._seqs)

    def slot(self, seq_id: int) -> int:
        return self._seq(seq_id).working

    def checkpoint(self, key: bytes) -> int | None:
        return self._checkpoints.get(key)

    def can_start(self) -> bool:
        return self.num_free >= 1

    def take_ops(self) -> list[tuple[str, int, int]]:
        ops, self.ops = self.ops, []
        return ops

    # ---- sequences ----

    def usable_hit(self, keys: list[bytes]) -> int:
        """The most leading blocks of `keys` (a prompt's cached blocks) whose last one ends at a checkpoint."""
        return next((h for h in range(len(keys), 0, -1) if keys[h - 1] in self._checkpoints), 0)

    def start_prompt(self, seq_id: int, hit_keys: list[bytes], attention_hit: int, block_size: int) -> None:
        """A new sequence's working slot, restored from the checkpoint at the end of its hit (if
        any); where its attention blocks hit further, a checkpoint is wanted there: a branch point,
        where the next prompt that shares this prefix can resume."""
        self.start(seq_id, hit_keys[-1] if hit_keys else None, len(hit_keys) * block_size)
        if attention_hit > len(hit_keys):
            self._seq(seq_id).wanted.add(attention_hit * block_size)

    def start(self, seq_id: int, resume_from: bytes | None = None, tokens: int = 0) -> None:
        """A working slot for a new sequence, holding the checkpoint `resume_from` (of the state
        after `tokens` tokens) or, without one, nothing: its first step starts fresh."""
        if seq_id in self._seqs or seq_id in self._swapped:
            raise BlockError(f"seq {seq_id} already has a state slot")
        source = None
        if resume_from is not None:
            source = self._checkpoints[resume_from]
            self._checkpoints.move_to_end(resume_from)  # (used: the last to be evicted)
            self.stats.checkpoint_hits += 1
            self.stats.checkpoint_hit_tokens += tokens
        slot = self._take()
        assert slot is not None, "caller checked can_start"
        if source is not None:
            self.ops.append(("copy", source, slot))  # (queued before the take could reuse `source`)
        self._seqs[seq_id] = SeqState(slot)

    def plan_saves(self, seq_id: int, start: int, end: int, block_size: int, decode: bool) -> list[tuple[int, int]]:
        """The saves of a chunk computing positions [start, end): (block end, slot) pairs, slots
        taken now (pending until `file`). Skipped where the pool cannot spare a slot."""
        seq = self._seq(seq_id)
        last = end // block_size * block_size
        if last <= start:
            return []
        ends = {last} | {b for b in seq.wanted if start < b <= end}
        seq.wanted -= ends
        saves = []
        for b in sorted(ends):
            # (working slots first: leave one for every sequence the scheduler may still start)
            if self.num_free <= self.max_live - len(self._seqs):
                break
            slot = self._take()
            if slot is None:
                break
            seq.pending.append((b, slot, decode))
            saves.append((b, slot))
        return saves

    def file(self, seq_id: int, computed: int, keys: list[bytes], block_size: int) -> None:
        """After a step: file the pending checkpoints whose block end is computed, each under the
        key of the block it ends (`keys`: the sequence's block keys so far); pending ones whose key
        is missing (prefix caching off) or taken go back to the free list."""
        seq = self._seqs.get(seq_id)
        if seq is None or not seq.pending:
            return
        keep = []
        for b, slot, decode in seq.pending:
            if b > computed:
                keep.append((b, slot, decode))
                continue
            key = keys[b // block_size - 1] if b <= len(keys) * block_size else None
            if key is None or key in self._checkpoints:
                self._free.append(slot)
                continue
            self._checkpoints[key] = slot
            self._key_of[slot] = key
            self.stats.checkpoints_filed += 1
            if decode:
                seq.decode_keys.append(key)
                while len(seq.decode_keys) > DECODE_CHECKPOINTS:
                    self._drop(seq.decode_keys.pop(0))
        seq.pending = keep

    def fork(self, parent: int, child: int) -> None:
        """The child starts with a copy of the parent's state (n > 1: both go on from the prompt)."""
        self.start(child)
        self.ops.append(("copy", self.slot(parent), self.slot(child)))

    def free(self, seq_id: int) -> None:
        """A finished, aborted or recomputing sequence's slots back (its checkpoints stay)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self._free.append(seq.working)
        self._free += [slot for _, slot, _ in seq.pending]

    # ---- swap ----

    def can_swap_out(self) -> bool:
        return bool(self._host_free)

    def swap_out(self, seq_id: int) -> None:
        seq = self._seq(seq_id)
        host = self._host_free.pop()
        self.ops.append(("out", seq.working, host))
        self.free(seq_id)
        self._swapped[seq_id] = host

    def swap_in(self, seq_id: int) -> None:
        host = self._swapped.pop(seq_id)
        self.start(seq_id)
        self.ops.append(("in", host, self.slot(seq_id)))
        self._host_free.append(host)

    def free_swapped(self, seq_id: int) -> None:
        host = self._swapped.pop(seq_id, None)
        if host is not None:
            self._host_free.append(host)

    # ---- internals ----

    def _seq(self, seq_id: int) -> SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise BlockError(f"seq {seq_id} has no state slot") from None

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._checkpoints:
            return None
        key = next((k for k in self._checkpoints if not self.held(k)), next(iter(self._checkpoints)))
        slot = self._checkpoints.pop(key)
        del self._key_of[slot]
        self.stats.evictions += 1
        return slot

    def _drop(self, key: bytes) -> None:
        slot = self._checkpoints.pop(key, None)
        if slot is not None:
            del self._key_of[slot]
            self._free.append(slot)

    def snapshot(self, bytes_per_slot: int) -> StateSlotsSnapshot:
        stats = self.stats
        return StateSlotsSnapshot(self.num_slots, self.num_working, self.num_checkpoints, bytes_per_slot,
                                  stats.checkpoint_hits, stats.checkpoint_hit_tokens, stats.checkpoints_filed,
                                  stats.evictions)

    def check_invariants(self, live: set[int]) -> None:
        """Raise BlockError if a slot is lost or held twice, or live sequences and slots disagree."""
        if set(self._seqs) != live:
            raise BlockError(f"sequences with state slots {sorted(self._seqs)} are not the live ones {sorted(live)}")
        held = list(self._free) + list(self._checkpoints.values())
        for seq in self._seqs.values():
            held += [seq.working] + [slot for _, slot, _ in seq.pending]
        if sorted(held) != list(range(self.num_slots)):
            raise BlockError(f"state slots lost or held twice: {sorted(held)}")
        if set(self._key_of) != set(self._checkpoints.values()):
            raise BlockError("checkpoint keys and slots disagree")
        hosts = list(self._host_free) + list(self._swapped.values())
        if sorted(hosts) != list(range(self.num_host_slots)):
            raise BlockError(f"host state slots lost or held twice: {sorted(hosts)}")
