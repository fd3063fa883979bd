"""Sliding-window KV memory: per-group block tables over one pool (kv/groups.py), on tiny pools.

Block size 4 and a window of 6 throughout: a query at position p sees keys p-5..p, so once 12
tokens are computed, block 0 (positions 0..3) can never be read again.
"""

from __future__ import annotations

import random

import pytest

from inferd.engine.kv.block_manager import BlockManager
from inferd.engine.kv.groups import KVLayout, first_needed_block, usable_hit
from inferd.engine.sched.request import RequestStatus
from inferd.engine.sched.scheduler import Scheduler
from inferd.text.sampling_params import SamplingParams
from inferd.engine.sched.request import Request
from inferd.settings.policy import SchedulingPolicy, ShedConfig

BS, W = 4, 6
HYBRID = (None, W)  # group 0 full, group 1 sliding


def prompt(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def run(bm: BlockManager, seq_id: int, tokens: list[int]) -> int:
    """Allocate `tokens` (reusing cached blocks) and commit them as computed; the hit's tokens."""
    hit = bm.allocate(seq_id, len(tokens), tokens)
    assert hit is not None
    bm.commit(seq_id, len(tokens), lambda a, b: tokens[a:b])
    return hit


def held(bm: BlockManager, seq_id: int, group: int) -> list[int]:
    table = bm.block_table(seq_id, group)
    return table[bm._starts[seq_id][group]:]


def test_layout_groups_layers_by_window() -> None:
    assert KVLayout.for_layers([None] * 4).windows == (None,)  # Llama: one group, as always
    assert KVLayout.for_layers([8] * 3).groups[0].layers == (0, 1, 2)  # Mistral with a window
    gemma3 = KVLayout.for_layers([None if i % 6 == 5 else 1024 for i in range(12)])
    assert gemma3.group_size == 2 and gemma3.windows == (None,) + (1024,) * 5
    assert gemma3.groups[0].layers == (5, 11) and gemma3.groups[3].layers == (4, 6)
    assert sorted(gemma3.placement()) == [(g, s) for g in range(6) for s in range(2)]
    assert gemma3.blocks_held(8192, 16, 512) == 512 + 5 * (-(-1536 // 16) + 2)


def test_layout_keeps_kv_shapes_apart_and_places_a_shared_layer_at_its_source() -> None:
    """Gemma 4 shaped: full layers with their own K/V shape, the last two layers reading layers 1 and 2."""
    small, wide = (2, 16), (1, 32)
    gemma4 = KVLayout.for_layers([W, W, None, W, None], shapes=[small, small, wide, small, wide], sources=[0, 1, 2, 1, 2])
    assert [(g.window, g.layers, g.shape) for g in gemma4.groups] == [(None, (2,), wide), (W, (0,), small),
                                                                       (W, (1,), small)]
    assert gemma4.num_layers == 5 and gemma4.placement() == [(1, 0), (2, 0), (0, 0), (2, 0), (0, 0)]
    mixed = KVLayout.for_layers([None] * 4, shapes=[small, wide, small, wide])  # one window, two shapes
    assert [(g.layers, g.shape) for g in mixed.groups] == [((1, 3), wide), ((0, 2), small)]


def test_blocks_behind_the_window_go_back_to_the_pool_as_decode_passes() -> None:
    bm = BlockManager(16, BS, windows=HYBRID)
    tokens = prompt(5)
    run(bm, 0, tokens)
    for n in range(6, 30):  # decode one token at a time, committing as the scheduler does
        assert bm.append(0, 1) == []
        tokens.append(100 + n)
        bm.commit(0, n, lambda a, b: tokens[a:b])
        assert bm._starts[0][1] == min(first_needed_block(W, n, BS), bm.blocks_for(n) - 1)
        assert len(held(bm, 0, 0)) == bm.blocks_for(n)  # the full group keeps everything
        assert len(held(bm, 0, 1)) <= -(-W // BS) + 1
        bm.check_invariants()
    assert bm.block_table(0, 1)[:5] == [0] * 5
    bm.free(0)
    bm.check_invariants()
    assert bm.num_free_blocks == 16  # whole


def test_chunked_prefill_keeps_the_window_behind_the_next_chunk() -> None:
    bm = BlockManager(32, BS, windows=(W,))  # every layer sliding: one group
    tokens = prompt(40)
    assert bm.allocate(0, 10, tokens) == 0
    bm.commit(0, 10, lambda a, b: tokens[a:b])
    assert bm._starts[0] == [1]  # the next query, at 10, sees 5..10: blocks 1 and 2
    assert bm.append(0, 10) == []
    bm.commit(0, 20, lambda a, b: tokens[a:b])
    assert held(bm, 0, 0) == bm.block_table(0)[3:] and len(held(bm, 0, 0)) == 2
    bm.free(0)
    assert bm.num_free_blocks == 32


def test_a_prefix_hit_takes_the_full_prefix_and_only_the_window_at_its_end() -> None:
    bm = BlockManager(32, BS, windows=HYBRID)
    first = prompt(22)
    assert bm.allocate(1, 22, first) == 0
    full_blocks, window_blocks = list(bm.block_table(1, 0)), list(bm.block_table(1, 1))
    bm.commit(1, 22, lambda a, b: first[a:b])
    bm.free(1)
    assert bm.num_free_blocks == 32  # cached blocks are evictable, so allocatable
    second = first + [900, 901, 902]  # the next turn extends the first
    assert bm.cached_prefix(second) == 20
    assert bm.allocate(2, len(second), second) == 20
    assert bm.block_table(2, 0)[:5] == full_blocks[:5]
    start = first_needed_block(W, 20, BS)  # the query at 20 sees 15..20: blocks 3 and 4
    assert start == 3 and bm.block_table(2, 1)[:5] == [0, 0, 0] + window_blocks[3:5]
    bm.check_invariants()
    bm.commit(2, len(second), lambda a, b: second[a:b])
    bm.free(2)
    assert bm.num_free_blocks == 32


def test_a_hit_shrinks_to_where_a_sliding_group_still_has_its_window() -> None:
    bm = BlockManager(32, BS, windows=HYBRID)
    first = prompt(22)
    assert bm.allocate(1, 22, first) == 0
    window_blocks = list(bm.block_table(1, 1))
    bm.commit(1, 22, lambda a, b: first[a:b])
    bm.free(1)
    assert bm.cached_prefix(first + [7]) == 20
    # evict the sliding group's block 4: a hit of 5 blocks lacks its window; one of 4 has it
    bm.prefix_cache._evictable.move_to_end(window_blocks[4], last=False)
    assert bm.prefix_cache.evict() == window_blocks[4]
    bm.pool._free.append(window_blocks[4])
    bm.check_invariants()
    assert bm.cached_prefix(first + [7]) == 16
    found = [[1, 2, 3, 4, 5], [None, None, 3, 4, None]]
    assert usable_hit(found, HYBRID, BS) == 4
    assert usable_hit([[1, 2], [None, 2]], (None, 1), BS) == 2  # a window of 1: the last block only


def test_fork_and_copy_on_write_in_every_group() -> None:
    bm = BlockManager(32, BS, windows=HYBRID)
    tokens = prompt(14)
    run(bm, 0, tokens)
    bm.fork(0, 1)
    pairs = bm.append(1, 1)
    assert pairs is not None and len(pairs) == 2  # each group's shared last block copied
    for seq in (0, 1):
        bm.commit(seq, 14, lambda a, b: tokens[a:b])
    bm.check_invariants()
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 32


def make(num_blocks: int, num_host_blocks: int = 0, mode: str = "recompute") -> Scheduler:
    bm = BlockManager(num_blocks, BS, num_host_blocks=num_host_blocks, windows=HYBRID)
    policy = SchedulingPolicy(preemption_mode=mode, shedding=ShedConfig(enabled=False))  # type: ignore[arg-type]
    return Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, policy=policy)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pool_is_whole_after_finish_abort_and_preemption(mode: str) -> None:
    s = make(24, num_host_blocks=24, mode=mode)
    bm = s.block_manager
    cls = s.policy.classes[0]
    requests = [Request(i, prompt(9, 100 * i), SamplingParams(max_tokens=12, ignore_eos=True), 64, priority_class=cls)
                for i in range(4)]
    for r in requests:
        s.add(r)
    for _ in range(200):
        if not s.has_work():
            break
        plan = s.schedule()
        s.update(plan, {c.request.seq_id: 7 for c in plan.chunks if c.samples})
        for r in list(s.running):
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
        if requests[3].num_computed_tokens > 12:  # one aborted half way
            s.finish(requests[3], RequestStatus.FINISHED_ABORTED)
        bm.check_invariants()
    assert not s.has_work() and s.num_preemptions > 0
    assert all(len(r.output_ids) == 12 for r in requests[:3])
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 24 and bm.num_free_host_blocks == 24


class RandomRun:
    """Random allocate (shared prefixes) / append / commit / fork / free / swap on a hybrid
    manager, against a fake KV cache: every slot holds (group, the tokens up to it), so a
    sequence must read back its own tokens over every group's held blocks."""

    def __init__(self, seed: int, windows: tuple[int | None, ...]) -> None:
        self.rng = random.Random(seed)
        num_blocks = self.rng.randint(8, 40)
        self.bm = BlockManager(num_blocks, BS, num_host_blocks=self.rng.randint(0, 30), windows=windows)
        self.cache: dict[int, tuple[int, tuple[int, ...]]] = {}  # slot -> (group, tokens up to it)
        self.host: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.tokens: dict[int, list[int]] = {}  # live sequences
        self.swapped: dict[int, list[int]] = {}
        self.prompts: list[list[int]] = [[]]
        self.next_seq = 0

    def write(self, seq: int, start: int, end: int) -> None:
        bm, tokens = self.bm, self.tokens[seq]
        for g in range(len(bm.windows)):
            table = bm.block_table(seq, g)
            for p, slot in zip(range(start, end), bm.slots(seq, start, end, g)):
                assert bm.pool.refcount(table[p // BS]) == 1 and bm.prefix_cache.key(table[p // BS]) is None
                self.cache[slot] = (g, tuple(tokens[:p + 1]))

    def copy(self, pairs: list[tuple[int, int]], src: dict, dst: dict) -> None:
        for a, b in pairs:
            for i in range(BS):
                if a * BS + i in src:
                    dst[b * BS + i] = src[a * BS + i]

    def step(self) -> None:
        rng, bm = self.rng, self.bm
        op = rng.choice(["allocate", "allocate", "append", "append", "fork", "free", "swap_out", "swap_in"])
        live, swapped = sorted(self.tokens), sorted(self.swapped)
        if op == "allocate" or not live and op != "swap_in":
            base = rng.choice(self.prompts)
            prompt = base[:rng.randint(0, len(base))] + [rng.randint(0, 2) for _ in range(rng.randint(1, 30))]
            seq, n = self.next_seq, rng.randint(1, len(prompt))
            hit = bm.allocate(seq, n, prompt, reserve=rng.randint(0, 2))
            if hit is not None:
                self.next_seq += 1
                self.tokens[seq] = prompt[:n]
                self.prompts.append(prompt)
                self.write(seq, hit, n)
                bm.commit(seq, n, lambda a, b: prompt[a:b])
        elif op == "append":
            seq = rng.choice(live)
            new = [rng.randint(0, 2) for _ in range(rng.randint(0, 9))]
            old = len(self.tokens[seq])
            pairs = bm.append(seq, len(new))
            if pairs is not None:
                self.copy(pairs, self.cache, self.cache)
                self.tokens[seq] += new
                self.write(seq, old, old + len(new))
                tokens = self.tokens[seq]
                bm.commit(seq, len(tokens), lambda a, b: tokens[a:b])
        elif op == "fork":
            parent = rng.choice(live)
            bm.fork(parent, self.next_seq)
            self.tokens[self.next_seq] = list(self.tokens[parent])
            self.next_seq += 1
        elif op == "free":
            seq = rng.choice(live)
            bm.free(seq)
            del self.tokens[seq]
        elif op == "swap_out":
            seq = rng.choice(live)
            pairs = bm.swap_out(seq)
            if pairs is not None:
                self.copy(pairs, self.cache, self.host)
                self.swapped[seq] = self.tokens.pop(seq)
        elif swapped:
            seq = rng.choice(swapped)
            pairs = bm.swap_in(seq)
            if pairs is not None:
                self.copy(pairs, self.host, self.cache)
                self.tokens[seq] = self.swapped.pop(seq)
        self.check()

    def check(self) -> None:
        bm = self.bm
        bm.check_invariants()
        for seq, tokens in self.tokens.items():
            for g, window in enumerate(bm.windows):
                start = bm._starts[seq][g]
                assert start <= first_needed_block(window, len(tokens), BS)  # what a next query needs is held
                first = start * BS
                slots = bm.slots(seq, first, len(tokens), g)
                assert [self.cache[s] for s in slots] == [(g, tuple(tokens[:p + 1])) for p in range(first, len(tokens))]

    def finish(self) -> None:
        for seq in list(self.tokens):
            self.bm.free(seq)
        for seq in list(self.swapped):
            self.bm.free_swapped(seq)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.pool.num_blocks
        assert self.bm.num_free_host_blocks == self.bm.num_host_blocks


@pytest.mark.parametrize("windows", [HYBRID, (W,), (None, W, W)])
def test_random_operations_keep_every_window_readable(windows: tuple[int | None, ...]) -> None:
    for seed in range(3):
        run = RandomRun(seed, windows)
        for _ in range(150):
            run.step()
        run.finish()


@pytest.mark.soak
@pytest.mark.parametrize("windows", [HYBRID, (W,), (None, W, W), (None, 1)])
def test_random_operations_keep_every_window_readable_long(windows: tuple[int | None, ...]) -> None:
    for seed in range(60):
        run = RandomRun(seed, windows)
        for _ in range(600):
            run.step()
        run.finish()
