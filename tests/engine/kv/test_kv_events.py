"""KV-cache events (kv/events.py) from a small BlockManager: what the prefix cache files and drops,
with hashes recomputed here from the documented formula, never from inferd's own `block_key`;
then a seeded random workload whose events, applied to an index as a router keeps one, must
describe exactly what each tier holds."""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence
from hashlib import blake2b

from inferd.engine.kv.block_manager import BlockManager
from inferd.engine.kv.events import CPU, GPU, BlockRemoved, BlockStored, KVEventRecorder

BS = 4
ROOT = bytes(range(16))  # a tenant's / cache_salt's namespace (16 bytes, as api/admission/door.py makes)


def documented_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """docs/fleet.md's block hash: blake2b(parent || int32 little-endian token ids, 16 bytes)."""
    return blake2b(parent + b"".join(struct.pack("<i", t) for t in tokens), digest_size=16).digest()


def chain(tokens: Sequence[int], root: bytes = b"") -> list[bytes]:
    keys, parent = [], root
    for i in range(len(tokens) // BS):
        parent = documented_hash(parent, tokens[i * BS:(i + 1) * BS])
        keys.append(parent)
    return keys


def manager(num_blocks: int = 16, tenant_token_ids: bool = False, **kwargs) -> BlockManager:
    return BlockManager(num_blocks, BS, events=KVEventRecorder(BS, tenant_token_ids), **kwargs)


def events(bm: BlockManager) -> list:
    return bm.tiers.events.take()  # type: ignore[union-attr]


def run(bm: BlockManager, seq: int, tokens: list[int], root: bytes = b"", reuse: bool = True) -> None:
    """A prompt allocated (reusing its cached prefix, if `reuse`), computed whole, and freed."""
    assert bm.allocate(seq, len(tokens), tokens if reuse else None, root=root) is not None
    bm.commit(seq, len(tokens), lambda a, b: tokens[a:b])
    bm.free(seq)
    bm.check_invariants()


def prompt(tag: int, blocks: int) -> list[int]:
    return [tag * 1000 + i for i in range(blocks * BS + 1)]  # (+1: the last token, never cached)


def test_a_prompts_full_blocks_are_one_stored_run() -> None:
    bm = manager()
    tokens = prompt(1, 3)
    run(bm, 0, tokens)
    [stored] = events(bm)
    assert stored == BlockStored(chain(tokens), None, tokens[:12], BS, GPU, None, 0)


def test_a_later_run_chains_to_the_block_before_it() -> None:
    bm = manager()
    tokens = prompt(1, 4)
    assert bm.allocate(0, len(tokens), tokens) == 0
    bm.commit(0, 9, lambda a, b: tokens[a:b])  # two blocks full ...
    bm.commit(0, 17, lambda a, b: tokens[a:b])  # ... then two more
    first, second = events(bm)
    keys = chain(tokens)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == (keys[:2], None, tokens[:8])
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == (keys[2:], keys[1], tokens[8:16])


def test_a_key_filed_already_is_not_stored_again() -> None:
    bm = manager()
    a = prompt(1, 3)
    b = a[:8] + [7, 7, 7, 7] + a[12:]  # a's first two blocks, then its own third
    run(bm, 0, a)
    events(bm)
    assert bm.allocate(1, len(b), None) == 0  # (computed again, not reused: its first two keys are taken)
    bm.allocate(2, len(a), None)  # (a again, alongside: every key taken)
    bm.commit(1, len(b), lambda x, y: b[x:y])
    bm.commit(2, len(a), lambda x, y: a[x:y])
    [stored] = events(bm)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == ([chain(b)[2]], chain(a)[1], b[8:12])


def test_evictions_are_removed_events_merged_in_order() -> None:
    bm = manager(num_blocks=4)
    a, b = prompt(1, 3), prompt(2, 3)
    run(bm, 0, a)
    run(bm, 1, b)  # needs 4 blocks: the free one, then a's three (tail first)
    stored_a, removed, stored_b = events(bm)
    assert removed == BlockRemoved(list(reversed(chain(a))), GPU, 0)
    assert stored_b.block_hashes == chain(b)


def test_each_kv_group_is_stored_and_removed_under_its_index() -> None:
    bm = manager(num_blocks=8, windows=(None, 64))  # a full group and a sliding one: one key, two groups
    a = prompt(1, 2)
    run(bm, 0, a)
    full, sliding = events(bm)
    assert (full.block_hashes, full.group_idx) == (chain(a), 0)
    assert (sliding.block_hashes, sliding.group_idx, sliding.token_ids) == (chain(a), 1, a[:8])
    run(bm, 1, prompt(2, 3))  # 6 blocks: a's 4 evicted
    removed = [e for e in events(bm) if isinstance(e, BlockRemoved)]
    assert sorted((e.group_idx, h) for e in removed for h in e.block_hashes) == sorted(
        (g, h) for g in (0, 1) for h in chain(a))  # (the hash without the group's tag)


def test_a_namespace_rides_on_the_first_block_and_withholds_tokens() -> None:
    bm = manager()
    tokens = prompt(1, 3)
    assert bm.allocate(0, len(tokens), tokens, root=ROOT) == 0
    bm.commit(0, 8, lambda a, b: tokens[a:b])
    bm.commit(0, 12, lambda a, b: tokens[a:b])
    first, later = events(bm)
    keys = chain(tokens, ROOT)
    assert first == BlockStored(keys[:2], None, [], BS, GPU, [(ROOT.hex(),), None], 0)
    assert later == BlockStored(keys[2:], keys[1], [], BS, GPU, [None], 0)
    assert keys != chain(tokens)  # (the namespace is the first block's parent)


def test_tenant_token_ids_publishes_a_namespaces_tokens() -> None:
    bm = manager(tenant_token_ids=True)
    tokens = prompt(1, 2)
    run(bm, 0, tokens, root=ROOT)
    [stored] = events(bm)
    assert (stored.token_ids, stored.extra_keys) == (tokens[:8], [(ROOT.hex(),), None])


def test_the_host_tier_is_medium_cpu() -> None:
    bm = manager(num_blocks=3, num_tier_blocks=3)
    a, b = prompt(1, 2), prompt(2, 2)
    run(bm, 0, a)
    run(bm, 1, b)  # 3 blocks: a's two go to the host tier
    ka, kb = chain(a), chain(b)
    got = events(bm)
    assert got[1:] == [
        BlockRemoved([ka[1]], GPU), BlockStored([ka[1]], ka[0], a[4:8], BS, CPU),  # (tail first)
        BlockRemoved([ka[0]], GPU), BlockStored([ka[0]], None, a[:4], BS, CPU),
        BlockStored(kb, None, b[:8], BS, GPU),
    ]
    bm.tiers.take_copies()
    run(bm, 2, a)  # a comes back from the host tier; b goes to it, a's 3-block tier drops one entry
    got = events(bm)
    back = [e for e in got if isinstance(e, BlockStored) and e.medium == GPU]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in back] == [([ka[0]], None, a[:4]),
                                                                                  ([ka[1]], ka[0], a[4:8])]
    assert any(isinstance(e, BlockRemoved) and e.medium == CPU for e in got)


def test_a_block_the_full_host_tier_cannot_take_is_only_removed() -> None:
    bm = manager(num_blocks=2, num_tier_blocks=1)
    a, b = prompt(1, 1), prompt(2, 1)
    run(bm, 0, a)
    run(bm, 1, b)  # a's block goes to the tier
    bm.tiers.take_copies()
    events(bm)
    assert bm.allocate(2, len(a), a) == 4  # a's block back from the tier (pinned there this step) ...
    got = events(bm)  # ... evicting b's, which the tier has no room for
    [kb], [ka] = chain(b), chain(a)
    assert got == [BlockStored([ka], None, a[:4], BS, GPU), BlockRemoved([kb], GPU)]
    assert set(bm.tiers.events._filed) == {ka}  # (b's block is in neither tier: nothing kept for it)


def test_off_records_nothing() -> None:
    bm = BlockManager(4, BS, num_tier_blocks=2)
    assert bm.prefix_cache.events is None and bm.tiers.events is None and bm.tiers.host.on_drop is None


def apply(index: set[tuple[str, int, bytes]], batch: list, parents: dict[bytes, bytes | None]) -> None:
    """What a router does with a batch: add stored blocks, drop removed ones (checking each stored
    hash against its parent and tokens, where they are published)."""
    for event in batch:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for i, block_hash in enumerate(event.block_hashes):
                index.add((event.medium, event.group_idx, block_hash))
                root = bytes.fromhex(event.extra_keys[i][0]) if event.extra_keys and event.extra_keys[i] else b""
                if event.token_ids:
                    assert block_hash == documented_hash(parent or root, event.token_ids[i * BS:(i + 1) * BS])
                parents[block_hash] = parent
                parent = block_hash
        else:
            for block_hash in event.block_hashes:
                index.remove((event.medium, event.group_idx, block_hash))


def test_a_routers_index_follows_both_tiers_exactly() -> None:
    rng = random.Random(46)
    bm = manager(num_blocks=12, num_tier_blocks=6, tenant_token_ids=True)
    index: set[tuple[str, int, bytes]] = set()
    parents: dict[bytes, bytes | None] = {}
    prefixes = [prompt(tag, 3) for tag in range(6)]
    for seq in range(300):
        base = rng.choice(prefixes)
        tokens = base[:rng.randint(1, 3) * BS] + [rng.randint(0, 50) for _ in range(rng.randint(1, 9))]
        run(bm, seq, tokens, root=ROOT if rng.random() < 0.2 else b"")
        if rng.random() < 0.5:
            bm.tiers.take_copies()
        apply(index, events(bm), parents)
        device = {(GPU, 0, key) for key in bm.prefix_cache._cached}
        host = {(CPU, 0, key) for entries in (bm.tiers.host._probation, bm.tiers.host._protected) for key in entries}
        assert index == device | host, seq
    assert set(bm.tiers.events._filed) == {key for _, _, key in index}  # (nothing kept for blocks gone)
