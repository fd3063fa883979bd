"""safetensors files with hostile headers (issue 46): what `inferd serve` does with them.

A safetensors file is an 8-byte header length, a JSON header ({name: {dtype, shape,
data_offsets: [begin, end]}}, "__metadata__"), then the bytes. Hypothesis mutates a real one
(model_files.write_tiny_folder: safetensors.torch.save_file's) in a Hugging Face folder, loaded
by `load_model` as `inferd serve` loads it:

- the header length: 0, past the file, 2^63, 2^64 - 1 (-1), one off;
- the JSON, parsed and changed: a dtype unknown or of another width, a shape empty, with a 0, a
  -1, 2^40 or 2^63, a float or a string in it, dims added; data_offsets past the end, reversed,
  negative, huge, overlapping another tensor's, not a pair; a tensor dropped, renamed, given twice
  (the same key twice in the JSON text); __metadata__ of the wrong type;
- bit flips and random bytes in the header; a truncation anywhere.

The property (model_files.loads_or_refuses): the load succeeds or raises ModelLoadError with a
one-line message naming the file, within a time limit, without a giant allocation.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_files import loads_or_refuses, write_tiny_folder

from inferd.engine.builder import load_model
from inferd.engine.config import EngineConfig

HUGE = (2**31, 2**40, 2**53, 2**63, 2**64 - 1)
DTYPES = ("F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "XX", "", 7, None)
SHAPES = st.one_of(st.sampled_from(([], [0], [-1], [2**40, 32], [2**63], [1.5, 32], ["32"], [1] * 9, None)),
                   st.lists(st.integers(-2, 2**20), min_size=1, max_size=4))


class Mutant:
    """A valid safetensors file, split into its header (JSON) and its bytes, and mutants of it."""

    def __init__(self, data: bytes) -> None:
        self.original = data
        n = struct.unpack_from("<Q", data)[0]
        self.header: dict[str, Any] = json.loads(data[8:8 + n])
        self.body = data[8 + n:]
        self.names = [k for k in self.header if k != "__metadata__"]

    def mutate(self, draw: Any) -> bytes:
        header = json.loads(json.dumps(self.header))
        twice = None
        for _ in range(draw(st.integers(1, 2))):
            twice = self.change(header, draw) or twice
        text = json.dumps(header, separators=(",", ":"))
        if twice is not None:  # the same key twice: JSON allows it, a reader must pick or refuse
            text = text[:-1] + "," + json.dumps(twice[0]) + ":" + json.dumps(twice[1]) + "}"
        raw = text.encode()
        raw += b" " * (-len(raw) % 8)
        data = bytearray(struct.pack("<Q", len(raw)) + raw + self.body)
        for _ in range(draw(st.sampled_from((0, 0, 0, 1, 2)))):
            how = draw(st.sampled_from(("length", "flip", "bytes", "truncate")))
            if how == "length" and len(data) >= 8:
                value = draw(st.sampled_from((0, 1, len(raw) - 1, len(raw) + 1, len(data), 100 * 2**20 + 1, *HUGE)))
                struct.pack_into("<Q", data, 0, value % 2**64)
            elif how == "flip" and len(data) > 8:  # (positions alike: hypothesis' integers favour small ones)
                data[draw(st.randoms(use_true_random=False)).randrange(min(len(data), 8 + len(raw)))] ^= (
                    1 << draw(st.integers(0, 7)))
            elif how == "bytes" and len(data) > 8:
                at = draw(st.randoms(use_true_random=False)).randrange(min(len(data), 8 + len(raw)))
                chunk = draw(st.binary(min_size=1, max_size=16))
                data[at:at + len(chunk)] = chunk
            elif how == "truncate":
                del data[draw(st.randoms(use_true_random=False)).randrange(len(data) + 1):]
        return bytes(data)

    def change(self, header: dict[str, Any], draw: Any) -> tuple[str, Any] | None:
        """One change to the parsed header; a (key, value) to give twice, or None."""
        names = [k for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
        if not names:
            return None
        name = draw(st.sampled_from(names))
        entry = header[name]
        how = draw(st.sampled_from(("dtype", "shape", "offsets", "offsets", "overlap", "drop", "rename", "twice",
                                    "metadata", "entry", "reshape", "reshape", "retype", "swap", "swap")))
        shape = entry.get("shape")
        if how == "reshape" and isinstance(shape, list) and all(type(d) is int for d in shape):
            # (the same elements: safetensors agrees, the decoder's shape checks must not)
            entry["shape"] = draw(st.sampled_from((shape[::-1], [_count(shape)], [1, *shape],
                                                   [*shape, 1], [*shape[:-1], 1, shape[-1]] if shape else [1])))
        elif how == "retype":  # the same width: safetensors agrees
            entry["dtype"] = draw(st.sampled_from(("F16", "I16", "U16", "BF16")))
        elif how == "swap":  # two tensors' shapes and bytes exchanged
            other = draw(st.sampled_from(names))
            header[name], header[other] = header[other], header[name]
        elif how == "dtype":
            entry["dtype"] = draw(st.sampled_from(DTYPES))
        elif how == "shape":
            entry["shape"] = draw(SHAPES)
        elif how == "offsets":
            begin, end = self.header.get(name, {"data_offsets": [0, 2]})["data_offsets"]  # (as it was)
            entry["data_offsets"] = draw(st.sampled_from((
                [end, begin], [begin, len(self.body) + 2], [-2, end], [begin, 2**64 - 1], [begin, 2**63],
                [begin], [begin, end, end], [float(begin), end], None, [begin + 2, end + 2])))
        elif how == "overlap":
            other = header[draw(st.sampled_from(names))]
            entry["data_offsets"] = other.get("data_offsets")
        elif how == "drop":
            del header[name]
        elif how == "rename":
            header[draw(st.sampled_from(("model.layers.7.mlp.up_proj.weight", "lm_head.weight", "", "x" * 300,
                                         "model.layers.-1.input_layernorm.weight")))] = header.pop(name)
        elif how == "twice":
            return name, json.loads(json.dumps(entry))
        elif how == "metadata":
            header["__metadata__"] = draw(st.sampled_from(({"format": 1}, [], "pt", {"a": None}, {"format": "pt"})))
        else:
            header[name] = draw(st.sampled_from((None, [], 3, "tensor", {}, {"dtype": "F32"})))
        return None


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Mutant]:
    folder = write_tiny_folder(tmp_path_factory.mktemp("hf") / "tiny")
    return folder, Mutant((folder / "model.safetensors").read_bytes())


def serve_load(weights: str) -> Any:
    """`inferd serve`'s load of a folder: weights, tokenizer and decoder (engine/builder.py)."""
    dtype = "bfloat16" if weights == "auto" else "float32"
    return lambda path: load_model(EngineConfig.of(model=str(path), dtype=dtype, weights=weights, device="cpu"))


def test_the_tiny_folder_loads(folder: tuple[Path, Mutant]) -> None:
    path, mutant = folder
    (path / "model.safetensors").write_bytes(mutant.original)
    for weights in ("bf16", "auto"):
        assert loads_or_refuses(serve_load(weights), path) is None


@pytest.mark.parametrize("examples", [pytest.param(4000, marks=pytest.mark.soak), 60])
def test_a_mutated_safetensors_file_loads_or_is_refused(folder: tuple[Path, Mutant], examples: int) -> None:
    path, mutant = folder

    @settings(max_examples=examples, deadline=None, derandomize=examples < 1000, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.data(), st.sampled_from(("bf16", "auto")))
    def check(data: st.DataObject, weights: str) -> None:
        (path / "model.safetensors").write_bytes(mutant.mutate(data.draw))
        loads_or_refuses(serve_load(weights), path)

    check()
