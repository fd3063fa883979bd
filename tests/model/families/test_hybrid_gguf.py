"""GGUF files of the hybrid families as llama.cpp's converter writes them (conversion/qwen.py:
Qwen3NextModel, and for Qwen3.5 its _LinearAttentionVReorderBase): `qwen35`, `qwen35moe`,
`qwen3next`. What the converter does, and the loader undoes, written out again here: every norm
but the linear layers' gated one stored as 1 + w; A_log as A = -exp(A_log); dt_bias as
ssm_dt.bias; the conv squeezed to [C, K]; Qwen3-Next's in_proj_qkvz de-interleaved into attn_qkv
and attn_gate, its in_proj_ba kept as it is (ssm_ba); Qwen3.5's value heads reordered from grouped
to tiled; experts as [E, out, in] tensors; a multi-token-prediction block after the model's (skipped).

Tensors are float32 (the conventions, not the quantization, are what is tested), so the
reference is transformers' model itself.
"""

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
from family_cases import GREEDY, NEW_TOKENS  # noqa: E402
from test_gated_deltanet import FAMILIES, randomized  # noqa: E402

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402

ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
         "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_ba": "ssm_ba",
         "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


def tiled(t: torch.Tensor, cfg: Any, dim: int, size: int) -> torch.Tensor:
    """The converter's _reorder_v_heads: value heads from grouped [Hk, Hv/Hk, size] to tiled order."""
    shape = list(t.shape)
    hk = cfg.linear_num_key_heads
    t = t.reshape(*shape[:dim], hk, cfg.linear_num_value_heads // hk, size, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def linear_tensor(family: str, cfg: Any, module: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A linear-attention tensor as the converter writes it: (GGUF suffix, tensor) pairs."""
    dk, dv, hk = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_key_heads
    if module == "linear_attn.in_proj_qkvz":  # (Qwen3-Next's: [q, k, v, z] per key head -> qkv, z)
        r = cfg.linear_num_value_heads // hk
        q, k, v, z = t.t().reshape(cfg.hidden_size, hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        flat = [x.reshape(cfg.hidden_size, -1) for x in (q, k, v, z)]
        return [("attn_qkv.weight", torch.cat(flat[:3], -1).t()), ("attn_gate.weight", flat[3].t())]
    if module == "linear_attn.A_log":
        t, module = -torch.exp(t), "ssm_a"
    elif module == "linear_attn.dt_bias":
        module = "ssm_dt.bias"
    if family != "qwen3_next":  # (Qwen3.5: value heads to tiled order)
        qk = 2 * dk * hk
        if module in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
            t = torch.cat([t[:qk], tiled(t[qk:], cfg, 0, dv)])
        elif module == "linear_attn.in_proj_z":
            t = tiled(t, cfg, 0, dv)
        elif module in ("linear_attn.in_proj_b", "linear_attn.in_proj_a", "ssm_a", "ssm_dt.bias"):
            t = tiled(t, cfg, 0, 1)
        elif module == "linear_attn.out_proj":
            t = tiled(t, cfg, 1, dv)
    if module == "linear_attn.conv1d":
        t = t.squeeze()
    if module in ("ssm_a", "ssm_dt.bias"):
        return [(module, t)]
    return [(f"{NAMES[module]}.weight", t)]


def gguf_tensors(family: str, model: Any, mtp: bool) -> dict[str, np.ndarray]:
    cfg = model.config
    out: dict[str, torch.Tensor] = {"token_embd.weight": model.model.embed_tokens.weight,
                                    "output_norm.weight": 1 + model.model.norm.weight,
                                    "output.weight": model.lm_head.weight}
    for name, t in model.model.layers.state_dict().items():
        layer, rest = name.split(".", 1)
        t = t.detach().float()
        if rest.startswith("mlp.experts."):  # in memory [E, 2I, in] (gate rows, then up) and [E, out, I]
            if rest.endswith("gate_up_proj"):
                gate, up = t.chunk(2, dim=1)
                out |= {f"blk.{layer}.ffn_gate_exps.weight": gate, f"blk.{layer}.ffn_up_exps.weight": up}
            else:
                out[f"blk.{layer}.ffn_down_exps.weight"] = t
            continue
        module = rest.removesuffix(".weight")
        if module.startswith("linear_attn.") and module != "linear_attn.norm":
            out |= {f"blk.{layer}.{suffix}": w for suffix, w in linear_tensor(family, cfg, module, t)}
            continue
        if rest.endswith("norm.weight") and module != "linear_attn.norm":
            t = 1 + t  # (the converter's: x̂·(1 + w) stored as x̂·w')
        out[f"blk.{layer}.{NAMES[module]}.weight"] = t
    if mtp:  # a block after the model's own, as the converter writes the multi-token prediction's
        n = cfg.num_hidden_layers
        out |= {f"blk.{n}.nextn.eh_proj.weight": torch.zeros(cfg.hidden_size, 2 * cfg.hidden_size),
                f"blk.{n}.attn_norm.weight": torch.ones(cfg.hidden_size)}
    return {name: t.detach().float().numpy().copy() for name, t in out.items()}


def write(path: Path, family: str, model: Any, spm: dict[str, Any], mtp: bool) -> None:
    cfg = model.config
    w = tm.gguf_writer(path, ARCH[family], cfg, int(cfg.head_dim * 0.25), float(cfg.rope_parameters["rope_theta"]),
                       extra_blocks=int(mtp))
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(4)
    if family != "qwen3_next":
        w.add_rope_dimension_sections([11, 11, 10, 0])
    if getattr(cfg, "num_experts", 0):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if mtp:
        w.add_nextn_predict_layers(1)
    tm.write_spm_vocab(w, spm)
    tm.write_tensors(w, gguf_tensors(family, model, mtp), lambda name, array: gguf.GGMLQuantizationType.F32)


@pytest.mark.parametrize("family", list(ARCH))
def test_hybrid_gguf_matches_transformers(family: str, spm: dict[str, Any], tmp_path: Path) -> None:
    from inferd.text.tokenizer_loader import load_tokenizer

    torch.manual_seed(0)
    model = randomized(FAMILIES[family](len(spm["tokens"])))
    path = tmp_path / f"tiny-{family}.gguf"
    write(path, family, model, spm, mtp=family != "qwen3_next")
    prompts = [load_tokenizer(spm["folder"]).encode(p) for p in tm.PROMPTS]
    reference = tm.greedy_reference(model, prompts, NEW_TOKENS)
    tm.assert_not_trivial(reference, NEW_TOKENS)

    engine = LLMEngine.from_config(EngineConfig.of(model=str(path), dtype="float32", kv_cache_memory=16 * 2**20))
    cfg = engine.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.norm_offset, cfg.rope().rotary_dim) == (family, 4, 0.0, 4)
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == reference
