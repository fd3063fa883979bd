"""MXFP4, gpt-oss's expert format: dequantized as the format defines it (a bit-level reference
written here from the OCP spec), as transformers does, held exactly by 8-bit blocks, and a gpt-oss
folder whose experts are stored in MXFP4 served token for token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

import tiny_models as tm  # noqa: E402 - after the skips
from family_cases import NEW_TOKENS, build, generate  # noqa: E402
from test_moe_families import gpt_oss, strengthen  # noqa: E402

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.model.layers import mxfp4  # noqa: E402
from inferd.model.layers.linear import BlockLinear  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


def e2m1(nibble: int) -> float:
    """One FP4 value from its bits: sign, two exponent bits (bias 1), one mantissa bit."""
    sign = -1.0 if nibble & 0b1000 else 1.0
    exponent, mantissa = (nibble >> 1) & 0b11, nibble & 1
    magnitude = mantissa / 2 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return sign * magnitude


def reference_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out = torch.empty(*scales.shape, 32)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in scales.shape)).tolist():
        scale = 2.0 ** (int(scales[tuple(index)]) - 127)
        for byte_index, byte in enumerate(blocks[tuple(index)].tolist()):
            out[tuple(index)][2 * byte_index] = e2m1(byte & 0x0F) * scale
            out[tuple(index)][2 * byte_index + 1] = e2m1(byte >> 4) * scale
    return out.flatten(-2)


def random_blocks(*shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 135, shape, generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_dequantization_follows_the_format() -> None:
    blocks, scales = random_blocks(3, 5, 2)
    assert torch.equal(mxfp4.dequantize(blocks, scales), reference_dequantize(blocks, scales))


def test_dequantization_equals_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_blocks(2, 48, 4)  # [E, out, K / 32]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, out]
    assert torch.equal(mxfp4.dequantize(blocks, scales).transpose(1, 2), theirs)


def test_eight_bit_blocks_hold_mxfp4_exactly() -> None:
    blocks, scales = random_blocks(16, 3)
    q8 = mxfp4.to_q8_blocks(blocks, scales)
    assert q8 is not None and torch.equal(q8.dequantize(), mxfp4.dequantize(blocks, scales))
    scales[0, 0] = 255  # 2^128: out of float16's range
    assert mxfp4.to_q8_blocks(blocks, scales) is None


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] floats -> the nearest MXFP4 ([..., K / 32, 16] blocks, [..., K / 32] scales)."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2**-100))) - 2  # max / 2^e < 8
    scaled = groups / torch.exp2(exponent)[..., None]
    values = torch.tensor(mxfp4.E2M1)
    nibbles = (scaled[..., None] - values).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def write_mxfp4_folder(folder: Path) -> tuple[object, list[list[int]], list[list[int]]]:
    """A tiny gpt-oss whose experts are stored in MXFP4; transformers' model gets the same values."""
    from safetensors.torch import load_file, save_file

    case = build(folder, gpt_oss, prepare=strengthen)
    weights = load_file(folder / "model.safetensors")
    with torch.no_grad():
        for i, layer in enumerate(case.model.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, name)  # [E, in, out]
                blocks, scales = quantize(param.transpose(1, 2))  # along the inputs
                param.copy_(mxfp4.dequantize(blocks, scales).transpose(1, 2))
                key = f"model.layers.{i}.mlp.experts.{name}"
                del weights[key]
                weights[f"{key}_blocks"], weights[f"{key}_scales"] = blocks, scales
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router"]}
    (folder / "config.json").write_text(json.dumps(config))
    reference = tm.greedy_reference(case.model, case.prompts, NEW_TOKENS)
    return case.model, case.prompts, reference


def test_a_gpt_oss_folder_with_mxfp4_experts_matches_transformers(tmp_path: Path) -> None:
    _, prompts, reference = write_mxfp4_folder(tmp_path)
    engine = LLMEngine.from_config(EngineConfig.of(model=str(tmp_path), dtype="float32", kv_cache_memory=16 * 2**20))
    assert generate(engine, prompts) == reference


def test_packed_weights_keep_mxfp4_experts_as_eight_bit_blocks(tmp_path: Path) -> None:
    if not BlockLinear.fits((64, 64)):
        pytest.skip("this CPU does not run the block products (AVX-512 VNNI)")
    write_mxfp4_folder(tmp_path)
    engine = LLMEngine.from_config(EngineConfig.of(model=str(tmp_path), dtype="bfloat16", weights="auto",
                                                   kv_cache_memory=16 * 2**20))
    experts = engine.model.mixtures()[0].experts
    assert all(isinstance(op, BlockLinear) for e in experts for op in e.linears())
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "model.safetensors")
    blocks, scales = stored["model.layers.0.mlp.experts.down_proj_blocks"], stored["model.layers.0.mlp.experts.down_proj_scales"]
    assert torch.equal(experts[1].down.dequantize(), mxfp4.dequantize(blocks[1], scales[1]))
    assert len(generate(engine, [[5, 6, 7]])[0]) == NEW_TOKENS


def test_a_gpu_keeps_mxfp4_experts_as_stored(tmp_path: Path) -> None:
    """What load_model does on CUDA (keep_mxfp4), run here on the CPU: the experts stay MXFP4 bytes,
    dequantized when a step routes to them, and the tokens are transformers' still."""
    from inferd.model.layers.linear import Mxfp4Linear
    from inferd.model.loading.loader import load_checkpoint
    from inferd.model.models import decoder_for
    from inferd.text.tokenizer_loader import load_tokenizer

    _, prompts, reference = write_mxfp4_folder(tmp_path)
    checkpoint = load_checkpoint(tmp_path, torch.float32, "bf16", keep_mxfp4=True)
    experts = [t for name, t in checkpoint.tensors.items() if ".experts." in name and not name.endswith("_bias")]
    assert experts and all(isinstance(t, mxfp4.Mxfp4Weight) for t in experts)
    model = decoder_for(checkpoint.config, checkpoint.tensors, torch.float32)
    assert all(isinstance(op, Mxfp4Linear) for e in model.mixtures()[0].experts for op in e.linears())
    engine = LLMEngine(model, load_tokenizer(tmp_path), EngineConfig.of(model=str(tmp_path), dtype="float32",
                                                                         kv_cache_memory=16 * 2**20))
    assert generate(engine, prompts) == reference
