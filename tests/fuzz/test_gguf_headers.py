"""GGUF files with hostile headers (issue 46): what `inferd serve` does with them.

The 2026 attacks on model servers' GGUF readers (Ollama's CVE-2026-7482: tensor offsets and sizes
that point past the file) and their older cousins (a string length of 2^63, a tensor count of
2^40, an array of a billion elements, arrays nested until the stack ends) are mutations of a
valid file's header. Hypothesis mutates two real files:

- a whole tiny GGUF (model_files.write_tiny_gguf), loaded by `load_model`, the function
  `inferd serve` builds its engine with (GGUF header, config, tensor index, dequantization or
  packed codes, tokenizer, decoder): every mutant, thousands in the soak tier;
- the embedded SmolLM2-135M GGUF's real 1.8 MB header (49k tokens, 49k merges, 272 tensors) over
  a sparse copy of the file, read as `load_model` reads it before the weights: the header, the
  config, the tensor names and the tokenizer.

Mutations: a structural field (a count, a string's length, a value or array type, an array's
count, n_dims, a dim, a GGML type, a tensor's offset) set to an edge value (0, 2^31, 2^32 - 1,
2^40, 2^63, 2^64 - 1: -1, the file's length) or to its neighbour; a tensor's offset set to
another's (overlapping tensors) or past the end; bit flips and random bytes anywhere in the
header; a truncation anywhere. The property (model_files.loads_or_refuses): the load succeeds or
raises ModelLoadError with a one-line message naming the file, within a time limit and without
adding more than 2 GB of address space.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_files import (ARRAY, STRING, Field, Layout, encode, gguf_layout, loads_or_refuses, typed, with_entry,
                         write_tiny_gguf)

from inferd.engine.builder import load_model
from inferd.engine.config import EngineConfig
from inferd.text.gguf_file import GGUFFile

EDGES = (0, 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63, 2**64 - 1)
KINDS = ("count", "length", "type", "array", "dims", "dim", "ggml", "offset", "version")
NAN, INF = float("nan"), float("inf")
# a key's value in another type (or another value of its own): (GGUF value type, value[, element type])
RETYPED = st.one_of(
    st.tuples(st.just(4), st.sampled_from((0, 1, 3, 2**31, 2**32 - 1))),  # u32
    st.tuples(st.just(5), st.sampled_from((-1, -(2**31), 0))),  # i32
    st.tuples(st.just(10), st.sampled_from((0, 2**63, 2**64 - 1))),  # u64
    st.tuples(st.just(11), st.sampled_from((-1, -(2**63)))),  # i64
    st.tuples(st.sampled_from((6, 12)), st.sampled_from((NAN, INF, -INF, 0.0, -1.0, 0.5, 1e30))),  # f32, f64
    st.tuples(st.just(7), st.booleans()),
    st.tuples(st.sampled_from((0, 1, 2, 3)), st.integers(0, 127)),  # u8, i8, u16, i16
    st.tuples(st.just(STRING), st.sampled_from(("", "llama", "gpt2", "x" * 300, "\x00", "42", "nan", "a b"))),
    st.tuples(st.just(ARRAY), st.sampled_from(([], [0], [1, 2**32 - 1], [3] * 300)), st.just(4)),
    st.tuples(st.just(ARRAY), st.sampled_from(([], [""], ["a b"], ["Ġ"] * 3)), st.just(STRING)),
    st.tuples(st.just(ARRAY), st.sampled_from(([NAN], [1.0, -1.0])), st.just(6)),
    st.tuples(st.just(ARRAY), st.just([True, False]), st.just(7)),
    st.none(),  # the key left out
)


class Mutant:
    """A valid GGUF header (with its tensor data, or the length of the data left out: read as
    zeros from a sparse file), and mutated copies of it."""

    def __init__(self, data: bytes, tail: int = 0) -> None:
        self.original = data
        self.layout = gguf_layout(data)
        self.tail = tail

    def mutate(self, draw: Any) -> tuple[bytes, bool]:
        """(the bytes, whether they were cut): a key retyped or left out, or none; then 1 to 3
        mutations drawn with `draw` (hypothesis' data.draw)."""
        data, layout = self.original, self.layout
        key = draw(st.sampled_from(list(layout.entries))) if draw(st.booleans()) else None
        if key is not None:
            retyped = draw(RETYPED)
            data, layout = with_entry(data, layout, key, None if retyped is None else typed(*retyped))
        fields = {kind: [f for f in layout.fields if f.kind == kind] for kind in KINDS}
        mutated, cut = bytearray(data), False
        for _ in range(draw(st.integers(0 if key else 1, 3))):
            how = draw(st.sampled_from(("field", "field", "field", "overlap", "flip", "bytes", "truncate")))
            cut = cut or how == "truncate"
            self.apply(mutated, how, fields, layout, draw)
        return bytes(mutated), cut

    def apply(self, data: bytearray, how: str, fields: dict[str, list[Field]], layout: Layout, draw: Any) -> None:
        end = min(layout.index[1], len(data))  # (an earlier truncation may have cut the header)
        if end == 0:
            return
        if how == "field":
            kind = draw(st.sampled_from([k for k in KINDS if fields[k]]))
            self.set_field(data, draw(st.sampled_from(fields[kind])), draw)
        elif how == "overlap":  # a tensor's data at another's, or past the end of the file
            field, other = draw(st.sampled_from(fields["offset"])), draw(st.sampled_from(fields["offset"]))
            if max(field.offset, other.offset) + 8 <= len(data):
                past = len(data) + self.tail - layout.data_start
                value = draw(st.sampled_from((struct.unpack_from("<Q", data, other.offset)[0], past, past + 32)))
                struct.pack_into("<Q", data, field.offset, value % 2**64)  # (a cut file: -x wraps)
        elif how == "flip":  # (anywhere alike: hypothesis' integers favour small ones, the magic's bytes)
            data[draw(st.randoms(use_true_random=False)).randrange(end)] ^= 1 << draw(st.integers(0, 7))
        elif how == "bytes":
            at = draw(st.randoms(use_true_random=False)).randrange(end)
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[at:at + len(chunk)] = chunk
        else:
            del data[draw(st.randoms(use_true_random=False)).randrange(len(data)):]

    @staticmethod
    def set_field(data: bytearray, field: Field, draw: Any) -> None:
        if field.offset + field.size > len(data):
            return  # (cut off by an earlier truncation)
        fmt = "<Q" if field.size == 8 else "<I"
        mask = 2 ** (8 * field.size) - 1
        current = struct.unpack_from(fmt, data, field.offset)[0]
        value = draw(st.one_of(st.sampled_from(EDGES), st.sampled_from((current - 1, current + 1, len(data))),
                               st.integers(0, mask)))
        struct.pack_into(fmt, data, field.offset, value & mask)

    def write(self, path: Path, data: bytes, cut: bool) -> None:
        with open(path, "wb") as f:
            f.write(data)
            if self.tail and not cut:  # (the tensor data: zeros, in a sparse file)
                f.truncate(len(data) + self.tail)


# ------------------------------------------------------------------------ the tiny GGUF


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Mutant:
    return Mutant(write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes())


def serve_load(weights: str) -> Any:
    """`inferd serve`'s load of a file: weights, tokenizer and decoder (engine/builder.py)."""
    dtype = "bfloat16" if weights == "auto" else "float32"
    return lambda path: load_model(EngineConfig.of(model=str(path), dtype=dtype, weights=weights, device="cpu"))


def test_the_tiny_gguf_loads(tiny: Mutant, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(tiny.original)
    for weights in ("bf16", "auto"):
        assert loads_or_refuses(serve_load(weights), path) is None  # (the mutants' original is valid)
    assert {f.kind for f in tiny.layout.fields} == set(KINDS)


@pytest.mark.parametrize("examples", [pytest.param(4000, marks=pytest.mark.soak), 60])
def test_a_mutated_gguf_loads_or_is_refused(tiny: Mutant, tmp_path: Path, examples: int) -> None:
    path = tmp_path / "mutant.gguf"

    @settings(max_examples=examples, deadline=None, derandomize=examples < 1000, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.data(), st.sampled_from(("bf16", "auto")))
    def check(data: st.DataObject, weights: str) -> None:
        tiny.write(path, *tiny.mutate(data.draw))
        loads_or_refuses(serve_load(weights), path)

    check()


# ------------------------------------------------------------ the embedded SmolLM2 header


@pytest.fixture(scope="module")
def smollm2(default_gguf_head: tuple[Path, int]) -> Mutant:
    """The default GGUF's header; its tensor data is read as zeros (a sparse file)."""
    path, data_start = default_gguf_head
    with open(path, "rb") as f:
        return Mutant(f.read(data_start), path.stat().st_size - data_start)


def read_header(path: Path) -> None:
    """What `load_model` reads of a GGUF before its weights: header and tensor index, config,
    the tensor names it wants, tokenizer."""
    from inferd.model.families.registry import gguf_family
    from inferd.model.loading.loader import _gguf_config, _gguf_names
    from inferd.text.tokenizer_loader import load_tokenizer

    gguf = GGUFFile(path)
    try:
        family = gguf_family(gguf.metadata, str(path))
        config = _gguf_config(gguf.metadata, gguf.tensors, family, path)
        _gguf_names(gguf.tensors, family, config, path, gguf.metadata)
        load_tokenizer(path, gguf.metadata)
    finally:
        gguf.close()


@pytest.mark.parametrize("examples", [pytest.param(600, marks=pytest.mark.soak), 5])
def test_a_mutated_smollm2_header_is_read_or_refused(smollm2: Mutant, tmp_path: Path, examples: int) -> None:
    path = tmp_path / "smollm2.gguf"

    @settings(max_examples=examples, deadline=None, derandomize=examples < 100, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.data())
    def check(data: st.DataObject) -> None:
        smollm2.write(path, *smollm2.mutate(data.draw))
        loads_or_refuses(read_header, path)

    check()


def put(data: bytearray, field: Field, value: int) -> None:
    struct.pack_into("<Q" if field.size == 8 else "<I", data, field.offset, value)


def fields_of(tiny: Mutant, kind: str) -> list[Field]:
    return [f for f in tiny.layout.fields if f.kind == kind]


# name -> (how the tiny file is changed, what the refusal says)
ATTACKS: dict[str, tuple[Any, str]] = {
    "a tensor count of 2^40": (lambda d, t: put(d, fields_of(t, "count")[0], 2**40), "cannot fit"),
    "a key's length of 2^63": (lambda d, t: put(d, fields_of(t, "length")[0], 2**63), "truncated or corrupt"),
    "an array of a billion elements": (lambda d, t: put(d, fields_of(t, "array")[0], 10**9), "truncated or corrupt"),
    "a tensor offset of -1": (lambda d, t: put(d, fields_of(t, "offset")[-1], 2**64 - 1), "past the end"),
    "a tensor of 2^40 rows": (lambda d, t: put(d, fields_of(t, "dim")[1], 2**40), "past the end"),
    "overlapping tensors": (lambda d, t: put(d, fields_of(t, "offset")[-1],
                                             struct.unpack_from("<Q", d, fields_of(t, "offset")[-2].offset)[0]),
                            "overlap"),
    "a tensor of 5 dims": (lambda d, t: put(d, fields_of(t, "dims")[0], 5), "5 dims"),
    "an unknown GGML type": (lambda d, t: put(d, fields_of(t, "ggml")[0], 1000), "unknown GGML type"),
}


@pytest.mark.parametrize("attack", ATTACKS)
def test_the_known_attacks_are_refused_by_name(tiny: Mutant, tmp_path: Path, attack: str) -> None:
    change, says = ATTACKS[attack]
    data = bytearray(tiny.original)
    change(data, tiny)
    path = tmp_path / "attack.gguf"
    path.write_bytes(bytes(data))
    message = loads_or_refuses(serve_load("auto"), path)
    assert message is not None and says in message, message


# an array of an array of ... (10^5 deep) of one u32: 12 bytes a level
NESTED = struct.pack("<I", ARRAY) + struct.pack("<IQ", ARRAY, 1) * 10**5 + encode(ARRAY, [1], 4)


# name -> (a key, the value it is given: typed(...), what the refusal says)
HOSTILE: dict[str, tuple[str, bytes, str]] = {
    "alignment 0": ("general.alignment", typed(4, 0), "power of two"),
    "alignment a string": ("general.alignment", typed(STRING, "32"), "power of two"),
    "arrays nested 10^5 deep": ("tokenizer.ggml.tokens", NESTED, "array of arrays"),  # (past Python's stack)
    "tokens of integers": ("tokenizer.ggml.tokens", typed(ARRAY, [1, 2], 4),
                           "tokenizer.ggml.tokens must be an array of strings"),
    "2^31 layers": ("llama.block_count", typed(4, 2**31), "num_layers 2147483648 is out of range"),  # (a hang)
    "1000 layers": ("llama.block_count", typed(4, 1000), "declares 1000 layers, but the file holds tensors for 1"),
    "0 heads": ("llama.attention.head_count", typed(4, 0), "num_heads 0 is out of range"),
    "a width of words": ("llama.embedding_length", typed(STRING, "wide"), "malformed GGUF metadata (ValueError"),
    "2^30 positions": ("llama.context_length", typed(4, 2**30), "max_position_embeddings 1073741824 is out of range"),
    "an architecture list": ("general.architecture", typed(ARRAY, ["llama"], STRING), "unsupported architecture"),
}


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_metadata_is_refused_by_name(tiny: Mutant, tmp_path: Path, hostile: str) -> None:
    key, value, says = HOSTILE[hostile]
    path = tmp_path / "hostile.gguf"
    if key in tiny.layout.entries:
        path.write_bytes(with_entry(tiny.original, tiny.layout, key, value)[0])
    else:  # (a key the file lacks: general.alignment, added first)
        data = bytearray(tiny.original)
        put(data, fields_of(tiny, "count")[1], len(tiny.layout.entries) + 1)
        entry = typed(STRING, key)[4:] + value
        start = tiny.layout.fields[3].offset  # (the first entry)
        header = bytes(data[:start]) + entry + tiny.original[start:tiny.layout.index[1]]
        path.write_bytes(header + bytes(-len(header) % 32) + tiny.original[tiny.layout.data_start:])
    message = loads_or_refuses(serve_load("auto"), path)
    assert message is not None and says in message, message
