"""GGUF files of the mixture-of-experts families as llama.cpp's converter writes them: Mixtral (a
`llama` with experts, q/k rows interleaved), Qwen3-MoE (`qwen3moe`) and gpt-oss (`gpt-oss`: gate and
up split out of the interleaved tensor, experts in MXFP4, the MLP's norm named post_attention_norm).
Every expert sits in one [E, out, in] tensor. The reference is transformers' model with its weights
replaced by what the file holds (each tensor through its GGUF type and back), so the file's
conventions and inferd's reading of them are what is compared."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

import tiny_models as tm  # noqa: E402 - after the skips
from family_cases import NEW_TOKENS  # noqa: E402
from test_moe_families import YARN, gpt_oss, mixtral, qwen3_moe, strengthen  # noqa: E402

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.text.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}
ATTENTION = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "self_attn.sinks": "attn_sinks",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
ROUTER = {"mlp.gate": "ffn_gate_inp", "mlp.router": "ffn_gate_inp"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


def stacked_experts(family: str, model: Any, layer: int) -> dict[str, np.ndarray]:
    """A layer's experts as [E, out, in] (biases [E, out]) under llama.cpp's names."""
    mlp = model.model.layers[layer].mlp
    if family == "gpt_oss":  # [E, in, 2I], gate and up interleaved along 2I
        e = mlp.experts
        gate_up, bias = e.gate_up_proj.detach().transpose(1, 2), e.gate_up_proj_bias.detach()
        return {"ffn_gate_exps.weight": gate_up[:, 0::2], "ffn_up_exps.weight": gate_up[:, 1::2],
                "ffn_down_exps.weight": e.down_proj.detach().transpose(1, 2),
                "ffn_gate_exps.bias": bias[:, 0::2], "ffn_up_exps.bias": bias[:, 1::2],
                "ffn_down_exps.bias": e.down_proj_bias.detach()}
    # (transformers 5 keeps the others fused in memory: gate_up [E, 2I, in], down [E, in, I])
    gate, up = mlp.experts.gate_up_proj.detach().chunk(2, dim=1)
    return {"ffn_gate_exps.weight": gate, "ffn_up_exps.weight": up, "ffn_down_exps.weight": mlp.experts.down_proj.detach()}


def gguf_tensors(family: str, model: Any) -> dict[str, np.ndarray]:
    cfg = model.config
    out: dict[str, np.ndarray] = {"token_embd.weight": model.model.embed_tokens.weight.detach().numpy(),
                                  "output_norm.weight": model.model.norm.weight.detach().numpy(),
                                  "output.weight": model.lm_head.weight.detach().numpy()}
    for name, t in model.model.layers.state_dict().items():
        layer, rest = name.split(".", 1)
        module, _, kind = rest.rpartition(".")
        if module == "" and kind == "sinks":
            module, kind = "self_attn.sinks", "weight"
        target = ATTENTION.get(module) or ROUTER.get(module)
        if rest.startswith("self_attn.sinks"):
            target, kind = "attn_sinks", "weight"
        if module == "post_attention_layernorm":
            target = "post_attention_norm" if family == "gpt_oss" else "ffn_norm"
        if target is None:
            continue  # the experts: below
        w = t.detach().float().numpy().copy()
        if family == "mixtral" and target in ("attn_q", "attn_k") and kind == "weight":
            w = tm.permute_qk(w, cfg.num_attention_heads if target == "attn_q" else cfg.num_key_value_heads)
        out[f"blk.{layer}.{target}.{kind}"] = w
    for layer in range(cfg.num_hidden_layers):
        if family == "qwen3_moe" and layer in cfg.mlp_only_layers:
            continue
        for name, t in stacked_experts(family, model, layer).items():
            out[f"blk.{layer}.{name}"] = t.float().numpy().copy()
    return out


def qtype(family: str, name: str, array: np.ndarray) -> Any:
    types = gguf.GGMLQuantizationType
    if array.ndim == 3 and family == "gpt_oss":
        return types.MXFP4
    return types.Q8_0 if array.ndim >= 2 and "ffn_gate_inp" not in name else types.F32


def write(path: Path, family: str, model: Any, spm: dict[str, Any]) -> dict[str, np.ndarray]:
    """The GGUF file; returns what it holds, each tensor dequantized."""
    cfg, arch = model.config, ARCH[family]
    w = tm.gguf_writer(path, arch, cfg, cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads,
                       float(cfg.rope_parameters["rope_theta"]))
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if family == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "gpt_oss":
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(YARN["factor"])
        w.add_rope_scaling_orig_ctx_len(YARN["original_max_position_embeddings"])
        w.add_swiglu_clamp_exp([cfg.swiglu_limit] * cfg.num_hidden_layers)
    tm.write_spm_vocab(w, spm)
    return tm.write_tensors(w, gguf_tensors(family, model), lambda name, array: qtype(family, name, array))


def load_held(family: str, model: Any, held: dict[str, np.ndarray]) -> Any:
    """transformers' model with each weight replaced by what the file holds."""
    written = gguf_tensors(family, model)
    with torch.no_grad():
        for name, value in written.items():
            if not np.array_equal(value, held[name]):
                _assign(family, model, name, torch.from_numpy(held[name].copy()))
    return model


def _assign(family: str, model: Any, name: str, value: torch.Tensor) -> None:
    if name.startswith(("token_embd", "output")):
        {"token_embd.weight": model.model.embed_tokens.weight, "output.weight": model.lm_head.weight}[name].copy_(value)
        return
    _, layer, rest = name.split(".", 2)
    block = model.model.layers[int(layer)]
    target = rest.rsplit(".", 1)[0]
    if target in ("attn_q", "attn_k") and family == "mixtral":
        heads = model.config.num_attention_heads if target == "attn_q" else model.config.num_key_value_heads
        value = torch.from_numpy(tm.unpermute_qk(value.numpy(), heads).copy())
    attention = {v: k for k, v in ATTENTION.items()}
    if target in attention and "exps" not in target:
        module = block.get_submodule(attention[target])
        getattr(module, rest.rsplit(".", 1)[1]).copy_(value)
        return
    _assign_expert(family, block, rest, value)


def _assign_expert(family: str, block: Any, rest: str, value: torch.Tensor) -> None:
    if family == "gpt_oss":
        e = block.mlp.experts
        kind, _, suffix = rest.partition("_exps.")
        if kind == "ffn_down":
            (e.down_proj if suffix == "weight" else e.down_proj_bias).copy_(value.transpose(1, 2) if suffix == "weight"
                                                                            else value)
        else:
            half = 0 if kind == "ffn_gate" else 1
            if suffix == "weight":
                e.gate_up_proj[..., half::2] = value.transpose(1, 2)
            else:
                e.gate_up_proj_bias[..., half::2] = value
        return
    experts = block.mlp.experts
    kind = rest.partition("_exps.")[0]
    if kind == "ffn_down":
        experts.down_proj.copy_(value)
    else:
        size = experts.gate_up_proj.shape[1] // 2
        experts.gate_up_proj[:, (0 if kind == "ffn_gate" else size):][:, :size] = value



@pytest.mark.parametrize("family", list(ARCH))
def test_moe_gguf_matches_transformers(family: str, spm: dict[str, Any], tmp_path: Path) -> None:
    from inferd.text.tokenizer_loader import load_tokenizer

    factory = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss}[family]
    torch.manual_seed(0)
    model = strengthen(tm.randomize(factory(len(spm["tokens"])), seed=0))
    path = tmp_path / f"tiny-{family}.gguf"
    model = load_held(family, model, write(path, family, model, spm))
    prompts = [load_tokenizer(spm["folder"]).encode(p) for p in tm.PROMPTS]
    reference = tm.greedy_reference(model, prompts, NEW_TOKENS)
    tm.assert_not_trivial(reference, NEW_TOKENS)

    engine = LLMEngine.from_config(EngineConfig.of(model=str(path), dtype="float32", kv_cache_memory=64 * 2**20))
    assert engine.model_config.experts is not None
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == reference


def test_packed_weights_keep_gguf_experts_as_stored(spm: dict[str, Any], tmp_path: Path) -> None:
    """Q8_0 and MXFP4 experts on the block products, each expert's blocks as the file holds them."""
    from inferd.model.layers.linear import BlockLinear

    if not BlockLinear.fits((64, 64)):
        pytest.skip("this CPU does not run the block products (AVX-512 VNNI)")
    torch.manual_seed(0)
    model = strengthen(tm.randomize(gpt_oss(len(spm["tokens"])), seed=0))
    path = tmp_path / "tiny-gpt-oss.gguf"
    held = write(path, "gpt_oss", model, spm)
    engine = LLMEngine.from_config(EngineConfig.of(model=str(path), dtype="bfloat16", weights="auto",
                                                   kv_cache_memory=16 * 2**20))
    experts = engine.model.mixtures()[1].experts
    assert all(isinstance(op, BlockLinear) for e in experts for op in e.linears())
    assert np.array_equal(experts[2].down.dequantize().numpy(), held["blk.1.ffn_down_exps.weight"][2])
    assert len(engine.generate([[5, 6, 7]], GREEDY)[0].token_ids) == NEW_TOKENS
