"""The dense families: Llama (and Mistral), Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from inferd.model.families.family import (GGUF_EXPERT_NAMES, GGUF_LAYER_NAMES, GGUF_QK_NORM_NAMES, LLAMA_LAYER_NAMES, QK_NORM_NAMES,
                                          Family, gguf_experts, rope_variant, sliding_layers)

# Gemma's four norms: post_attention_layernorm is the norm *after* attention here, not the MLP's
GEMMA_LAYER_NAMES = LLAMA_LAYER_NAMES | {
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    # Mistral: one window for every layer when config.json sets one (null: full attention)
    return {"attention_bias": bool(cfg.get("attention_bias", False)), **sliding_layers(cfg, all_sliding=True)}


def _qwen(cfg: dict[str, Any], bias: bool) -> dict[str, Any]:
    # Qwen2/3 window only the layers `layer_types` marks (from max_window_layers), and only with
    # use_sliding_window; shipped checkpoints leave it off
    window = sliding_layers(cfg, all_sliding=False) if cfg.get("use_sliding_window") else {}
    return {"attention_bias": bool(cfg.get("attention_bias", bias)), **window}


def _gemma(cfg: dict[str, Any], version: int) -> dict[str, Any]:
    hidden = int(cfg["hidden_size"])
    fields: dict[str, Any] = {
        "norm_offset": 1.0, "sandwich_norms": True, "activation": "gelu_tanh",
        "embed_scale": math.sqrt(hidden),
        "query_scale": float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256) ** -0.5,
        "attn_softcap": cfg.get("attn_logit_softcapping"), "final_softcap": cfg.get("final_logit_softcapping"),
        "attention_bias": bool(cfg.get("attention_bias", False)), **sliding_layers(cfg, all_sliding=False),
    }
    if version == 3:
        fields["qk_norm"] = True
        if cfg.get("use_bidirectional_attention"):  # (EmbeddingGemma)
            fields["bidirectional"] = True
            if "sliding_window" in fields:
                # NOTE: transformers reads config.json's window S as W = S // 2 + 1 both ways,
                # |q - k| < W (Gemma3TextConfig.__post_init__, Gemma3TextModel's masks)
                fields["sliding_window"] = fields["sliding_window"] // 2 + 1
        fields["attn_softcap"] = None  # (Gemma 3 keeps the key in its config but does not apply it)
        per_type = cfg.get("rope_parameters") or {}
        if "full_attention" in per_type:  # transformers 5: one RoPE per layer type
            full, local = per_type["full_attention"], per_type.get("sliding_attention") or {}
            fields |= {"rope_theta": float(full.get("rope_theta", 1e6)), "rope_scaling": rope_variant(full),
                       "local_rope_theta": float(local.get("rope_theta", 10000.0)), "local_rope_scaling": rope_variant(local)}
        else:  # transformers 4's config.json: rope_theta, rope_local_base_freq, rope_scaling
            fields["local_rope_theta"] = float(cfg.get("rope_local_base_freq", 10000.0))
    return fields


def _phi3(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    fields = {"partial_rotary_factor": partial, **sliding_layers(cfg, all_sliding=True)}
    scaling = rope_variant(rope)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
        # (rope.py's _longrope: the long factors when the context is longer than the original one)
        original = int(scaling.get("original_max_position_embeddings")
                       or cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
        scaling = scaling | {"original_max_position_embeddings": original}
        fields["rope_scaling"] = scaling
    return fields


GGUF_GEMMA_NAMES = GGUF_LAYER_NAMES | {"post_attention_norm.weight": "post_attn_norm",
                                      "post_ffw_norm.weight": "post_mlp_norm"}
GGUF_PHI3_NAMES = {k: v for k, v in GGUF_LAYER_NAMES.items() if not k.startswith(("attn_q", "attn_k", "attn_v"))} | {
    "attn_qkv.weight": ("q", "k", "v"), "ffn_up.weight": ("gate", "up")}


def _gguf_plain(key: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    # (llama.cpp writes Mixtral as a Llama with experts)
    return {"experts": gguf_experts(key, common)} if key("expert_count", 0) else {}


def _gguf_gemma(version: int) -> Callable[[Callable[..., Any], dict[str, Any]], dict[str, Any]]:
    def read(key: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
        layers, hidden = common["num_layers"], common["hidden_size"]
        # llama.cpp's rule: 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) on the 27B models
        # (their query_pre_attn_scalar), which it tells by their depth
        big = layers == (46 if version == 2 else 62)
        scale = (hidden / common["num_heads"] if big else common["head_dim"]) ** -0.5
        every = 2 if version == 2 else 6  # every 2nd (6th) layer full, from the first sliding
        fields: dict[str, Any] = {
            "norm_offset": 0.0,  # the converter stored 1 + w
            "sandwich_norms": True, "activation": "gelu_tanh", "embed_scale": math.sqrt(hidden), "query_scale": scale,
            "sliding_window": int(key("attention.sliding_window", 4096)),
            "layer_types": tuple("full" if i % every == every - 1 else "sliding" for i in range(layers)),
        }
        if version == 2:
            fields |= {"attn_softcap": float(key("attn_logit_softcapping", 50.0)),
                       "final_softcap": float(key("final_logit_softcapping", 30.0))}
        else:
            fields |= {"qk_norm": True, "local_rope_theta": 10000.0}  # (llama.cpp's fixed local base)
        return fields

    return read


def _gguf_phi3(key: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    head_dim = common["hidden_size"] // common["num_heads"]
    fields: dict[str, Any] = {"head_dim": head_dim,
                              "partial_rotary_factor": int(key("rope.dimension_count", head_dim)) / head_dim}
    window = key("attention.sliding_window", 0)
    if window:
        fields |= {"sliding_window": int(window), "layer_types": ("sliding",) * common["num_layers"]}
    return fields


SILU = {"hidden_act": "silu", "mlp_bias": False}
GEMMA = {"hidden_activation": "gelu_pytorch_tanh"}
GEMMA2 = GEMMA | {"use_bidirectional_attention": False}  # (Gemma 3's: EmbeddingGemma, _gemma)
DENSE_FAMILIES = (
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM"), ("llama", "mistral"), _llama, refuse=SILU,
           gguf_architecture="llama", gguf_layer_names=GGUF_LAYER_NAMES | GGUF_EXPERT_NAMES, read_gguf=_gguf_plain),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), lambda c: _qwen(c, bias=True), refuse=SILU,
           gguf_architecture="qwen2", gguf_layer_names=GGUF_LAYER_NAMES,
           read_gguf=lambda key, common: {"attention_bias": True}),
    # (Qwen3Model, Gemma3TextModel: a trunk alone, as AutoModel saves an embedding model)
    Family("qwen3", ("Qwen3ForCausalLM", "Qwen3Model"), ("qwen3",), lambda c: _qwen(c, bias=False) | {"qk_norm": True},
           layer_names=LLAMA_LAYER_NAMES | QK_NORM_NAMES, refuse=SILU,
           gguf_architecture="qwen3", gguf_layer_names=GGUF_LAYER_NAMES | GGUF_QK_NORM_NAMES,
           read_gguf=lambda key, common: {"qk_norm": True}),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), lambda c: _gemma(c, 2), layer_names=GEMMA_LAYER_NAMES,
           refuse=GEMMA2, gguf_architecture="gemma2", gguf_layer_names=GGUF_GEMMA_NAMES, read_gguf=_gguf_gemma(2)),
    Family("gemma3", ("Gemma3ForCausalLM", "Gemma3TextModel"), ("gemma3_text",), lambda c: _gemma(c, 3),
           layer_names=GEMMA_LAYER_NAMES | QK_NORM_NAMES, refuse=GEMMA, gguf_architecture="gemma3",
           gguf_layer_names=GGUF_GEMMA_NAMES | GGUF_QK_NORM_NAMES, read_gguf=_gguf_gemma(3)),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), _phi3,
           fused={"self_attn.qkv_proj.weight": ("q", "k", "v"), "mlp.gate_up_proj.weight": ("gate", "up")},
           refuse={"hidden_act": "silu"}, gguf_architecture="phi3", gguf_layer_names=GGUF_PHI3_NAMES,
           read_gguf=_gguf_phi3),
)
