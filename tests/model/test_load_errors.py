"""Checkpoints that cannot be loaded give one line naming the problem, never a traceback.

The acceptance cases (a missing path, a truncated GGUF) run `inferd generate` as a real
subprocess: exit status non-zero, exactly one stderr line, `inferd: error: ...`. The rest go
through `LLMEngine.from_config` in-process (what the CLI calls) and must raise `ModelLoadError`
with a one-line message.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

import tiny_models as tm  # noqa: E402 - after the skips

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.text.errors import ModelLoadError  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


def load(path: Path) -> str:
    """The message `LLMEngine.from_config` fails with (it must fail with ModelLoadError)."""
    with pytest.raises(ModelLoadError) as info:
        LLMEngine.from_config(EngineConfig.of(model=str(path), dtype="float32", kv_cache_memory=16 * 2**20))
    message = str(info.value)
    assert message and "\n" not in message
    return message


def cli_error(model: Path, cwd: Path) -> str:
    """Run `inferd generate`; it must exit non-zero with one `inferd: error:` line on stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "inferd.cli", "generate", "hi", "--model", str(model), "--max-tokens", "2"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("inferd: error: ")
    assert proc.stdout == ""
    return lines[0]


@pytest.fixture(scope="module")
def smollm_head(default_gguf_head: tuple[Path, int]) -> tuple[bytes, int]:
    """The default GGUF's first bytes (header, tensor index and 1 MB of tensor data) and where
    its tensor data starts."""
    path, data_start = default_gguf_head
    with open(path, "rb") as f:
        return f.read(data_start + 2**20), data_start


# ------------------------------------------------------------------------------ as a subprocess


def test_cli_missing_path(tmp_path: Path) -> None:
    line = cli_error(tmp_path / "no-such-model.gguf", tmp_path)
    assert "no-such-model.gguf" in line and "no such file" in line


def test_cli_gguf_truncated_in_tensor_data(smollm_head: tuple[bytes, int], tmp_path: Path) -> None:
    head, data_start = smollm_head
    path = tmp_path / "cut.gguf"
    path.write_bytes(head[: data_start + 2**19])
    line = cli_error(path, tmp_path)
    assert str(path) in line and "truncated" in line
    assert "token_embd.weight" in line  # the first tensor that runs past the end


def test_cli_gguf_truncated_in_header(smollm_head: tuple[bytes, int], tmp_path: Path) -> None:
    head, data_start = smollm_head
    path = tmp_path / "cut.gguf"
    path.write_bytes(head[: data_start // 2])  # inside the metadata (the merges)
    line = cli_error(path, tmp_path)
    assert str(path) in line and "truncated" in line


# ------------------------------------------------------------------------------------ in-process


@pytest.mark.parametrize(
    "where", ["magic", "version", "tensor count", "token list", "merges", "tensor index"]
)
def test_gguf_truncated_in_header(where: str, smollm_head: tuple[bytes, int], tmp_path: Path) -> None:
    head, data_start = smollm_head
    cut = {
        "magic": 2, "version": 6, "tensor count": 12, "token list": 5000, "merges": data_start // 2,
        "tensor index": data_start - 100,
    }[where]
    path = tmp_path / "cut.gguf"
    path.write_bytes(head[:cut])
    message = load(path)
    assert str(path) in message
    assert "truncated" in message or "corrupt" in message


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    message = load(path)
    assert str(path) in message and "not a GGUF file" in message


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    message = load(path)
    assert str(path) in message and "GGUF" in message


@pytest.fixture(scope="module")
def spm_vocab(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("spm")
    tm.train_sentencepiece(folder)
    tokens, scores, types = tm.sentencepiece_vocab(folder / "tokenizer.model")
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types, "folder": folder}


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = load(path)
    assert "unsupported architecture 'gpt2'" in message and "llama" in message


def test_gguf_unsupported_tensor_type(spm_vocab: dict, tmp_path: Path) -> None:
    """An IQ2_XXS tensor (256-wide rows, 66 bytes a block): written raw, named in the error."""
    qtype = gguf.GGMLQuantizationType.IQ2_XXS
    model = tm.tiny_llama(len(spm_vocab["tokens"]), intermediate_size=256)
    raw = np.random.default_rng(0).integers(0, 256, (64, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    path = tmp_path / "iq2.gguf"
    tm.write_llama_gguf(path, model, spm_vocab, raw={"blk.1.ffn_down.weight": (raw, qtype)})
    message = load(path)
    assert str(path) in message and "blk.1.ffn_down.weight" in message and "IQ2_XXS" in message


def test_gguf_missing_tensor(spm_vocab: dict, tmp_path: Path) -> None:
    path = tmp_path / "missing.gguf"
    tm.write_llama_gguf(path, tm.tiny_llama(len(spm_vocab["tokens"])), spm_vocab, skip={"blk.1.ffn_up.weight"})
    message = load(path)
    assert "'layers.1.up'" in message and "missing" in message


# ------------------------------------------------------------------------- Hugging Face folders


@pytest.fixture(scope="module")
def hf_folder(spm_vocab: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A loadable tiny Llama folder (checked below); each test breaks a copy of it."""
    folder = tmp_path_factory.mktemp("hf") / "llama"
    shutil.copytree(spm_vocab["folder"], folder)
    tm.tiny_llama(len(spm_vocab["tokens"])).save_pretrained(folder, safe_serialization=True)
    return folder


def broken_copy(hf_folder: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    return folder


def test_intact_folder_loads(hf_folder: Path) -> None:
    engine = LLMEngine.from_config(EngineConfig.of(model=str(hf_folder), dtype="float32", kv_cache_memory=16 * 2**20))
    assert engine.model_config.num_layers == 2


@pytest.mark.parametrize(("key", "value", "tensor"), [
    ("intermediate_size", 96, "layers.0.gate"),
    ("num_key_value_heads", 4, "layers.0.k"),
    ("vocab_size", 512, "embed"),
])
def test_config_disagrees_with_weights(key: str, value: int, tensor: str, hf_folder: Path, tmp_path: Path) -> None:
    folder = broken_copy(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    message = load(folder)
    assert f"'{tensor}'" in message and "shape" in message


def test_folder_without_config(hf_folder: Path, tmp_path: Path) -> None:
    folder = broken_copy(hf_folder, tmp_path)
    (folder / "config.json").unlink()
    message = load(folder)
    assert str(folder) in message and "config.json" in message


@pytest.mark.parametrize("cut", ["header", "data"])
def test_truncated_safetensors(cut: str, hf_folder: Path, tmp_path: Path) -> None:
    folder = broken_copy(hf_folder, tmp_path)
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(100 if cut == "header" else size // 2)
    message = load(folder)
    assert str(weights) in message and "truncated" in message


@pytest.mark.parametrize("index", ['{"weight_map": ', "[]", '{"metadata": {}}'])
def test_corrupt_shard_index(index: str, hf_folder: Path, tmp_path: Path) -> None:
    folder = broken_copy(hf_folder, tmp_path)
    (folder / "model.safetensors.index.json").write_text(index)
    message = load(folder)
    assert str(folder / "model.safetensors.index.json") in message


def test_shard_listed_in_index_but_missing(hf_folder: Path, tmp_path: Path) -> None:
    folder = broken_copy(hf_folder, tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps({
        "weight_map": {"model.embed_tokens.weight": "model.safetensors", "lm_head.weight": "model-2.safetensors"},
    }))
    message = load(folder)
    assert "model-2.safetensors" in message and "missing" in message
