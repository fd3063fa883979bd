"""The mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss (their MLP: inferd.model.layers.moe)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from inferd.model.layers.moe import Experts
from inferd.model.families.family import (GGUF_EXPERT_NAMES, GGUF_LAYER_NAMES, GGUF_QK_NORM_NAMES, LLAMA_LAYER_NAMES,
                                          QK_NORM_NAMES, Family, gguf_experts, sliding_layers)
from inferd.text.errors import ModelLoadError

ATTENTION_NAMES = {k: v for k, v in LLAMA_LAYER_NAMES.items() if not k.startswith("mlp.")}
MIXTRAL_NAMES = ATTENTION_NAMES | {
    "block_sparse_moe.gate.weight": "moe.router",
    "block_sparse_moe.experts.{e}.w1.weight": "moe.experts.{e}.gate",
    "block_sparse_moe.experts.{e}.w3.weight": "moe.experts.{e}.up",
    "block_sparse_moe.experts.{e}.w2.weight": "moe.experts.{e}.down",
}
QWEN3_MOE_NAMES = LLAMA_LAYER_NAMES | QK_NORM_NAMES | {  # (the dense layers keep Llama's MLP names)
    "mlp.gate.weight": "moe.router",
    "mlp.experts.{e}.gate_proj.weight": "moe.experts.{e}.gate",
    "mlp.experts.{e}.up_proj.weight": "moe.experts.{e}.up",
    "mlp.experts.{e}.down_proj.weight": "moe.experts.{e}.down",
}
QWEN2_MOE_NAMES = {k: v for k, v in QWEN3_MOE_NAMES.items() if k not in QK_NORM_NAMES} | {
    "mlp.shared_expert.gate_proj.weight": "moe.shared.gate",
    "mlp.shared_expert.up_proj.weight": "moe.shared.up",
    "mlp.shared_expert.down_proj.weight": "moe.shared.down",
    "mlp.shared_expert_gate.weight": "moe.shared_gate",
}
GPT_OSS_NAMES = ATTENTION_NAMES | {
    "self_attn.o_proj.bias": "o_bias",
    "self_attn.sinks": "sinks",
    "mlp.router.weight": "moe.router",
    "mlp.router.bias": "moe.router_bias",
}


def _mixtral(cfg: dict[str, Any]) -> dict[str, Any]:
    experts = Experts(num_experts=_num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                      intermediate_size=int(cfg["intermediate_size"]))
    return {"experts": experts, **sliding_layers(cfg, all_sliding=True)}


def _qwen_moe(cfg: dict[str, Any], version: int) -> dict[str, Any]:
    layers, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if version == 2 else 0
    experts = Experts(num_experts=_num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                      intermediate_size=int(cfg["moe_intermediate_size"]),
                      renormalize=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense,
                      shared_intermediate_size=shared, shared_gate=bool(shared))
    window = sliding_layers(cfg, all_sliding=False) if cfg.get("use_sliding_window") else {}
    if version == 2:
        return {"experts": experts, "attention_bias": bool(cfg.get("qkv_bias", True)), **window}
    return {"experts": experts, "qk_norm": True, "attention_bias": bool(cfg.get("attention_bias", False)), **window}


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    quantization = cfg.get("quantization_config") or {}
    if quantization and quantization.get("quant_method") != "mxfp4":
        raise ModelLoadError(f"quantization {quantization.get('quant_method')!r} is not supported for gpt-oss "
                             "(supported: mxfp4, or none)")
    experts = Experts(num_experts=_num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                      intermediate_size=int(cfg["intermediate_size"]), scoring="topk_softmax", router_bias=True,
                      expert_bias=True, activation="swiglu_clamped",
                      swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    return {"experts": experts, "attention_bias": True, "output_bias": True, "attention_sinks": True,
            **sliding_layers(cfg, all_sliding=False)}


def _num_experts(cfg: dict[str, Any]) -> int:
    # transformers 5 writes num_local_experts; hub checkpoints (Qwen3-MoE) say num_experts
    count = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not count:
        raise ModelLoadError("config.json gives no expert count (num_local_experts or num_experts)")
    return int(count)


# gpt-oss keeps every expert in one tensor: gate_up_proj [E, hidden, 2I] with gate and up
# interleaved along its last axis (gate 0::2, up 1::2), down_proj [E, I, hidden]; biases [E, ...]
def _gate_up(t: torch.Tensor, cfg: Any) -> list[tuple[str, Any]]:
    return [(f"moe.experts.{e}.{name}", t[e, :, half::2].t().contiguous())
            for e in range(t.shape[0]) for half, name in ((0, "gate"), (1, "up"))]


def _gate_up_bias(t: torch.Tensor, cfg: Any) -> list[tuple[str, Any]]:
    return [(f"moe.experts.{e}.{name}_bias", t[e, half::2].contiguous())
            for e in range(t.shape[0]) for half, name in ((0, "gate"), (1, "up"))]


def _down(t: torch.Tensor, cfg: Any) -> list[tuple[str, Any]]:
    return [(f"moe.experts.{e}.down", t[e].t().contiguous()) for e in range(t.shape[0])]


def _down_bias(t: torch.Tensor, cfg: Any) -> list[tuple[str, Any]]:
    return [(f"moe.experts.{e}.down_bias", t[e]) for e in range(t.shape[0])]


def _gate_up_blocks(blocks: torch.Tensor, scales: torch.Tensor, keep: Keep) -> list[tuple[str, Any]]:
    # MXFP4 rows are outputs ([E, 2I, G, 16]): gate and up interleaved along them
    return [(f"moe.experts.{e}.{name}", keep(blocks[e, half::2], scales[e, half::2]))
            for e in range(blocks.shape[0]) for half, name in ((0, "gate"), (1, "up"))]


def _down_blocks(blocks: torch.Tensor, scales: torch.Tensor, keep: Keep) -> list[tuple[str, Any]]:
    return [(f"moe.experts.{e}.down", keep(blocks[e], scales[e])) for e in range(blocks.shape[0])]


Keep = Callable[[torch.Tensor, torch.Tensor], Any]  # one matrix's MXFP4 blocks and scales -> how it is kept
GPT_OSS_MICROSCALED = {"mlp.experts.gate_up_proj": _gate_up_blocks, "mlp.experts.down_proj": _down_blocks}
GPT_OSS_STACKED = {"mlp.experts.gate_up_proj": _gate_up, "mlp.experts.gate_up_proj_bias": _gate_up_bias,
                   "mlp.experts.down_proj": _down, "mlp.experts.down_proj_bias": _down_bias}

GGUF_GPT_OSS_NAMES: dict[str, str | tuple[str, ...]] = {
    k: v for k, v in GGUF_LAYER_NAMES.items() if not k.startswith("ffn_")} | GGUF_EXPERT_NAMES | {
    "post_attention_norm.weight": "mlp_norm",  # (the norm before gpt-oss's MLP, as llama.cpp names it)
    "attn_output.bias": "o_bias",
    "attn_sinks.weight": "sinks",
    "ffn_gate_inp.bias": "moe.router_bias",
    "ffn_gate_exps.bias": "moe.experts.{e}.gate_bias",
    "ffn_up_exps.bias": "moe.experts.{e}.up_bias",
    "ffn_down_exps.bias": "moe.experts.{e}.down_bias",
}


def _gguf_qwen3_moe(key: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True, "experts": gguf_experts(key, common)}


def _gguf_gpt_oss(key: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    limit = key("swiglu_clamp_exp", 7.0)  # (llama.cpp's fixed 7 unless the file gives one per layer)
    if isinstance(limit, list):
        if len(set(limit)) != 1:
            raise ModelLoadError("per-layer SwiGLU limits are not supported")
        limit = limit[0]
    experts = gguf_experts(key, common, scoring="topk_softmax", renormalize=False, router_bias=True,
                           expert_bias=True, activation="swiglu_clamped", swiglu_limit=float(limit))
    rope = common["rope_scaling"]
    layers = common["num_layers"]
    return {"experts": experts, "attention_bias": True, "output_bias": True, "attention_sinks": True,
            "sliding_window": int(key("attention.sliding_window", 128)),
            "layer_types": tuple("sliding" if i % 2 == 0 else "full" for i in range(layers)),
            # (transformers' gpt-oss: YaRN's correction range not rounded)
            "rope_scaling": rope | {"truncate": False} if rope else None}


SILU = {"hidden_act": "silu", "mlp_bias": False}
SPARSE_FAMILIES = (
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), _mixtral, layer_names=MIXTRAL_NAMES, refuse=SILU),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), lambda c: _qwen_moe(c, 2),
           layer_names=QWEN2_MOE_NAMES, refuse=SILU),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), lambda c: _qwen_moe(c, 3),
           layer_names=QWEN3_MOE_NAMES, refuse=SILU, gguf_architecture="qwen3moe",
           gguf_layer_names=GGUF_LAYER_NAMES | GGUF_QK_NORM_NAMES | GGUF_EXPERT_NAMES, read_gguf=_gguf_qwen3_moe),
    Family("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",), _gpt_oss, layer_names=GPT_OSS_NAMES,
           stacked=GPT_OSS_STACKED, microscaled=GPT_OSS_MICROSCALED, gguf_architecture="gpt-oss",
           gguf_layer_names=GGUF_GPT_OSS_NAMES, read_gguf=_gguf_gpt_oss),
)
