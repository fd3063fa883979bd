"""Gemma 4 (text: Gemma4ForCausalLM), read from config.json as transformers 5.25's Gemma4TextConfig
reads it; its decoder is inferd.model.gemma4.

Every key of Gemma4TextConfig that changes the maths is either read into a ModelConfig switch or
refused with its name (`Family.refuse`, and the ModelLoadErrors below):

    hidden_activation            gelu_pytorch_tanh only
    attention_bias               false only (true would put biases on q, k, v and o)
    use_bidirectional_attention  null or "vision" (text has no vision tokens: causal); "all" refused
    quantization_config          none
    layer_types, sliding_window  sliding and full layers (the default 5:1 pattern; the last layer
                                 always full, as transformers forces it)
    rope_parameters              one RoPE per layer type; full layers' "proportional"
    global_head_dim, num_global_key_value_heads, per_layer_config
                                 full layers' head size and KV heads (head_dim and
                                 num_key_value_heads only; the same for every layer of a type)
    num_kv_shared_layers         the last layers read the cache of the last earlier layer of their type
    attention_k_eq_v             full layers' values are their keys' projection
    use_double_wide_mlp          KV-shared layers' MLP twice as wide
    hidden_size_per_layer_input, vocab_size_per_layer_input   per-layer embeddings (0: none)
    enable_moe_block, num_experts, top_k_experts, moe_intermediate_size   the MoE block beside the MLP
    final_logit_softcapping      as Gemma 2/3

A GGUF file as llama.cpp's converter writes Gemma 4 (general.architecture "gemma4") is read into
the same switches (`_gguf_gemma4`, `_gguf_tensors`): its keys and tensor names are llama.cpp's
(conversion/gemma.py's Gemma4Model, src/models/gemma4*.cpp); a key or tensor that would change
the maths in a way inferd does not implement is refused with its name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import torch

from inferd.model.families.config import ModelConfig
from inferd.model.families.dense import GEMMA_LAYER_NAMES
from inferd.model.families.family import (GGUF_EXPERT_NAMES, GGUF_GEMMA_NAMES, GGUF_QK_NORM_NAMES, QK_NORM_NAMES,
                                          Family, rope_variant, sliding_layers)
from inferd.model.layers.moe import Experts
from inferd.text.errors import ModelLoadError

GEMMA4_LAYER_NAMES = GEMMA_LAYER_NAMES | QK_NORM_NAMES | {
    "layer_scalar": "layer_scalar",
    "per_layer_input_gate.weight": "per_layer_gate",
    "per_layer_projection.weight": "per_layer_projection",
    "post_per_layer_input_norm.weight": "post_per_layer_norm",
    "router.proj.weight": "moe.router",
    "router.scale": "moe.router_scale",
    "router.per_expert_scale": "moe.expert_scale",
    "pre_feedforward_layernorm_2.weight": "moe_norm",
    "post_feedforward_layernorm_1.weight": "post_mlp_norm_1",
    "post_feedforward_layernorm_2.weight": "post_moe_norm",
}
GEMMA4_TOP_NAMES = {"embed_tokens_per_layer.weight": "per_layer.embed",
                    "per_layer_model_projection.weight": "per_layer.projection",
                    "per_layer_projection_norm.weight": "per_layer.norm"}
# transformers' defaults where config.json leaves a key out (Gemma4TextConfig)
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


def _gemma4(cfg: dict[str, Any]) -> dict[str, Any]:
    types = _layer_types(cfg)
    cfg = cfg | {"layer_types": types, "sliding_window": cfg.get("sliding_window", 512)}
    size = int(cfg.get("hidden_size_per_layer_input", 256) or 0)
    vocab = int(cfg.get("vocab_size_per_layer_input", 262_144) or 0)
    if size and vocab < int(cfg["vocab_size"]):
        raise ModelLoadError(f"vocab_size_per_layer_input = {vocab} is below vocab_size = {cfg['vocab_size']}: "
                             "a token past it would have no per-layer embedding")
    return {
        "norm_float32": True, "sandwich_norms": True, "qk_norm": True, "value_norm": True, "activation": "gelu_tanh",
        "head_dim": int(cfg.get("head_dim") or 256),
        "embed_scale": int(cfg["hidden_size"]) ** 0.5, "query_scale": 1.0,  # (the q/k norms scale the scores)
        "final_softcap": cfg.get("final_logit_softcapping"),
        "keys_as_values": bool(cfg.get("attention_k_eq_v")), "double_wide_mlp": bool(cfg.get("use_double_wide_mlp")),
        "per_layer_input_size": size, "per_layer_vocab_size": vocab if size else 0,
        "kv_sources": _kv_sources(int(cfg.get("num_kv_shared_layers") or 0), types), "experts": _experts(cfg),
        **sliding_layers(cfg, all_sliding=False), **_rope(cfg, types), **_full_shape(cfg, types),
    }


def _layer_types(cfg: dict[str, Any]) -> list[str]:
    """config.json's layer types, or the default 5 sliding : 1 full; the last layer full."""
    n = int(cfg["num_hidden_layers"])
    types = list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                            for i in range(n)])
    if types:
        types[-1] = "full_attention"  # (Gemma4TextConfig forces it, with a warning)
    return types


def _rope(cfg: dict[str, Any], types: list[str]) -> dict[str, Any]:
    """Each layer type's RoPE: full layers' as rope_theta / rope_scaling, sliding ones' as the local pair."""
    per_type = cfg.get("rope_parameters") or DEFAULT_ROPE
    fields: dict[str, Any] = {}
    for kind, (theta, scaling) in (("full_attention", ("rope_theta", "rope_scaling")),
                                   ("sliding_attention", ("local_rope_theta", "local_rope_scaling"))):
        rope = per_type.get(kind)
        if kind not in types:
            continue
        if not rope:
            raise ModelLoadError(f"rope_parameters has no entry for {kind} layers")
        variant = rope_variant(rope)
        if variant is not None and variant.get("rope_type") != "proportional" and float(
                variant.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ModelLoadError(f"rope_parameters.{kind}.partial_rotary_factor is implemented for proportional "
                                 "RoPE only")
        fields |= {theta: float(rope["rope_theta"]), scaling: variant}
    return fields


def _full_shape(cfg: dict[str, Any], types: list[str]) -> dict[str, Any]:
    """Full layers' head size and KV heads: per_layer_config where config.json has it, else what
    Gemma4TextConfig derives (global_head_dim, default 512; num_global_key_value_heads where
    attention_k_eq_v). Only head_dim and num_key_value_heads, the same for every layer of a type."""
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        overrides: dict[str, Any] = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
            overrides["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        per_layer = {i: overrides for i, t in enumerate(types) if t == "full_attention"}
    layers = {int(i): dict(o) for i, o in per_layer.items()}
    for i, overrides in layers.items():
        unknown = sorted(set(overrides) - set(PER_LAYER_KEYS))
        if unknown:
            raise ModelLoadError(f"per_layer_config sets {', '.join(unknown)} on layer {i} (inferd implements "
                                 f"{', '.join(PER_LAYER_KEYS)} only)")
    base = {"head_dim": int(cfg.get("head_dim") or 256), "num_key_value_heads": int(cfg["num_key_value_heads"])}
    shape = {kind: {tuple(int(layers.get(i, {}).get(k, base[k])) for k in PER_LAYER_KEYS)
                    for i, t in enumerate(types) if t == kind} for kind in set(types)}
    for kind, shapes in shape.items():
        if len(shapes) > 1 or (kind == "sliding_attention" and shapes != {(base["head_dim"],
                                                                           base["num_key_value_heads"])}):
            raise ModelLoadError(f"per_layer_config: {kind} layers of several shapes {sorted(shapes)} (inferd "
                                 "implements full layers' own head_dim and num_key_value_heads only)")
    head_dim, kv_heads = next(iter(shape.get("full_attention", {(base["head_dim"], base["num_key_value_heads"])})))
    return {"full_head_dim": head_dim, "full_kv_heads": kv_heads}


def _kv_sources(shared: int, types: list[str], key: str = "num_kv_shared_layers") -> tuple[int, ...]:
    """transformers' kv_sharing_modes: from layer n - num_kv_shared_layers on, each layer reads the
    K/V that the last earlier layer of its type stored, and computes none of its own."""
    n = len(types)
    if not shared:
        return ()
    if shared >= n:
        raise ModelLoadError(f"{key} = {shared} of {n} layers: no layer would store a cache "
                             "(an assistant model reading another's is not served)")
    first = n - shared
    sources = list(range(n))
    for layer in range(first, n):
        producers = [i for i in range(first) if types[i] == types[layer]]
        if not producers:
            raise ModelLoadError(f"{key} = {shared}: no {types[layer]} layer before layer {first} "
                                 f"stores the cache layer {layer} reads")
        sources[layer] = producers[-1]
    return tuple(sources)


def _experts(cfg: dict[str, Any]) -> Experts | None:
    """The MoE block beside the dense MLP: softmax over every expert, the top k renormalised, then
    times each expert's scale; the router reads the un-normed residual, RMS-normed and scaled."""
    if not cfg.get("enable_moe_block"):
        return None
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if not cfg.get(key):
            raise ModelLoadError(f"enable_moe_block without {key}")
    return Experts(num_experts=int(cfg["num_experts"]), top_k=int(cfg["top_k_experts"]),
                   intermediate_size=int(cfg["moe_intermediate_size"]), renormalize=True, activation="gelu_tanh",
                   router_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), expert_scale=True)


# every expert in one tensor: gate_up_proj [E, 2I, hidden] (gate rows, then up), down_proj [E, hidden, I]
def _gate_up(t: torch.Tensor, cfg: Any) -> list[tuple[str, Any]]:
    half = t.shape[1] // 2
    return [(f"moe.experts.{e}.{name}", t[e, rows].contiguous())
            for e in range(t.shape[0]) for name, rows in (("gate", slice(0, half)), ("up", slice(half, None)))]


def _down(t: torch.Tensor, cfg: Any) -> list[tuple[str, Any]]:
    return [(f"moe.experts.{e}.down", t[e].contiguous()) for e in range(t.shape[0])]


# ------------------------------------------------------------------------------ GGUF
# llama.cpp's converter (conversion/gemma.py, Gemma4Model) keeps the norms as they are (x̂·w, no
# 1 + w), writes the experts' gate_up_proj as one tensor (gate rows, then up), the router's scale
# and per-expert scale as ffn_gate_inp.scale and ffn_down_exps.scale, a KV-shared layer without
# k, v or k_norm, a full layer with keys as values without v, and full layers' proportional RoPE
# as rope_freqs: 1 for the pairs that turn, 1e30 for the rest (loader._gguf_rope).
GGUF_GEMMA4_NAMES = {k: v for k, v in (GGUF_GEMMA_NAMES | GGUF_QK_NORM_NAMES | GGUF_EXPERT_NAMES).items()
                     if not k.endswith(".bias")} | {
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_gate",
    "proj.weight": "per_layer_projection",
    "post_norm.weight": "post_per_layer_norm",
    "ffn_gate_inp.scale": "moe.router_scale",
    "ffn_down_exps.scale": "moe.expert_scale",
    "ffn_gate_up_exps.weight": ("moe.experts.{e}.gate", "moe.experts.{e}.up"),
    "pre_ffw_norm_2.weight": "moe_norm",
    "post_ffw_norm_1.weight": "post_mlp_norm_1",
    "post_ffw_norm_2.weight": "post_moe_norm",
}
GGUF_GEMMA4_TOP_NAMES = {"per_layer_token_embd.weight": "per_layer.embed",
                         "per_layer_model_proj.weight": "per_layer.projection",
                         "per_layer_proj_norm.weight": "per_layer.norm"}


def _gguf_gemma4(key: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    """The metadata as llama.cpp's converter writes it (and llama.cpp's gemma4 model reads it)."""
    n = common["num_layers"]
    sliding = key("attention.sliding_window_pattern")  # (a flag per layer: true for sliding)
    if not isinstance(sliding, list) or len(sliding) != n:
        raise ModelLoadError(f"gemma4.attention.sliding_window_pattern = {sliding!r}: inferd reads one flag per "
                             f"layer ({n})")
    if common["rope_scaling"] is not None:
        raise ModelLoadError(f"gemma4.rope.scaling.type = {common['rope_scaling']}: not implemented for Gemma 4")
    if not key("attention.causal", True):
        raise ModelLoadError("gemma4.attention.causal = false: bidirectional attention is not implemented")
    shared = int(key("attention.shared_kv_layers", 0))
    sources = _kv_sources(shared, ["sliding_attention" if s else "full_attention" for s in sliding],
                          "gemma4.attention.shared_kv_layers")
    for layer in range(n - shared, n):  # llama.cpp's rule: a shared sliding layer reads layer n - shared - 2,
        theirs = n - shared - (2 if sliding[layer] else 1)  # a full one n - shared - 1 (layer_reuse_cb)
        if sources[layer] != theirs:
            raise ModelLoadError(f"gemma4.attention.shared_kv_layers = {shared}: layer {layer} reads layer "
                                 f"{sources[layer]}'s cache in transformers, layer {theirs}'s in llama.cpp")
    size = int(key("embedding_length_per_layer_input"))
    fields: dict[str, Any] = {
        "norm_float32": True, "sandwich_norms": True, "qk_norm": True, "value_norm": True, "activation": "gelu_tanh",
        "embed_scale": common["hidden_size"] ** 0.5, "query_scale": 1.0,
        "final_softcap": float(key("final_logit_softcapping", 0.0)) or None,
        "layer_types": tuple("sliding" if s else "full" for s in sliding), "kv_sources": sources,
        "per_layer_input_size": size, "per_layer_vocab_size": common["vocab_size"] if size else 0,
        "experts": _experts({"enable_moe_block": True, "num_experts": key("expert_count"),
                             "top_k_experts": key("expert_used_count"),
                             "moe_intermediate_size": key("expert_feed_forward_length"),
                             "rms_norm_eps": common["rms_norm_eps"]}) if key("expert_count", 0) else None,
    }
    if any(sliding):
        fields |= {"sliding_window": int(key("attention.sliding_window")),
                   "local_rope_theta": float(key("rope.freq_base_swa"))}
    if not all(sliding):
        fields["rope_theta"] = float(key("rope.freq_base"))
    return fields | _gguf_shapes(key, sliding) | _gguf_mlp(key, sources, n)


def _gguf_shapes(key: Callable[..., Any], sliding: list[bool]) -> dict[str, Any]:
    """Each layer type's head size (attention.key_length, _swa for sliding layers) and KV heads
    (attention.head_count_kv: an array where full layers have their own); values and RoPE span the
    whole head (the proportional part: rope_freqs)."""
    head = {False: int(key("attention.key_length")), True: int(key("attention.key_length_swa"))}
    for swa, suffix in ((False, ""), (True, "_swa")):
        for name in (f"attention.value_length{suffix}", f"rope.dimension_count{suffix}"):
            if swa in sliding and int(key(name)) != head[swa]:
                raise ModelLoadError(f"gemma4.{name} = {key(name)} is not gemma4.attention.key_length{suffix} = "
                                     f"{head[swa]} (inferd implements values and RoPE over the whole head)")
    kv = key("attention.head_count_kv")
    per_layer = [int(h) for h in kv] if isinstance(kv, list) else [int(kv)] * len(sliding)
    heads = {swa: {h for h, s in zip(per_layer, sliding) if s == swa} for swa in (False, True)}
    if len(per_layer) != len(sliding) or any(len(h) > 1 for h in heads.values()):
        raise ModelLoadError(f"gemma4.attention.head_count_kv = {kv}: inferd implements one count per layer type")
    sliding_heads, full_heads = (next(iter(heads[swa] or heads[not swa])) for swa in (True, False))
    return {"head_dim": head[True], "full_head_dim": head[False], "num_kv_heads": sliding_heads,
            "full_kv_heads": full_heads}


def _gguf_mlp(key: Callable[..., Any], sources: tuple[int, ...], n: int) -> dict[str, Any]:
    """The MLP's width: feed_forward_length, an array where KV-shared layers' are twice as wide."""
    ffn = key("feed_forward_length")
    widths = [int(f) for f in ffn] if isinstance(ffn, list) else [int(ffn)] * n
    wide = [widths[0] * (2 if sources and sources[i] != i else 1) for i in range(n)]
    if widths not in (wide, [widths[0]] * n):
        raise ModelLoadError(f"gemma4.feed_forward_length = {ffn}: inferd implements one width, or the KV-shared "
                             "layers' twice as wide")
    return {"intermediate_size": widths[0], "double_wide_mlp": widths != [widths[0]] * n}


def _gguf_tensors(cfg: ModelConfig, names: Collection[str]) -> ModelConfig:
    """What only the tensors' presence says: full layers without v (keys as values), the per-expert
    scale (optional in llama.cpp); and what inferd requires of them: rope_freqs for full layers, the
    MoE block in every layer."""
    own_full = [i for i in range(cfg.num_layers) if not cfg.is_sliding(i) and cfg.kv_source(i) == i]
    if own_full and "rope_freqs.weight" not in names:
        raise ModelLoadError("no tensor 'rope_freqs.weight': full layers' RoPE is unknown")
    without_v = [i for i in own_full if f"blk.{i}.attn_v.weight" not in names]
    if without_v and without_v != own_full:
        raise ModelLoadError(f"tensor 'blk.{without_v[0]}.attn_v.weight' is missing, but other full layers have "
                             "theirs (inferd implements keys as values on every full layer or none)")
    experts = cfg.experts
    if experts is not None:
        if experts.dense_layers:
            raise ModelLoadError(f"no tensor 'blk.{experts.dense_layers[0]}.ffn_gate_inp.weight': inferd implements "
                                 "the MoE block in every layer or none")
        scaled = [f"blk.{i}.ffn_down_exps.scale" in names for i in range(cfg.num_layers)]
        if any(scaled) and not all(scaled):
            raise ModelLoadError(f"tensor 'blk.{scaled.index(False)}.ffn_down_exps.scale' is missing, but other "
                                 "layers have theirs")
        experts = replace(experts, expert_scale=all(scaled))
    return replace(cfg, keys_as_values=bool(without_v), experts=experts)


GEMMA4 = Family(
    "gemma4", ("Gemma4ForCausalLM",), ("gemma4_text",), _gemma4, layer_names=GEMMA4_LAYER_NAMES,
    refuse={"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "use_bidirectional_attention": "vision",
            "quantization_config": None},
    stacked={"experts.gate_up_proj": _gate_up, "experts.down_proj": _down}, top_names=GEMMA4_TOP_NAMES,
    gguf_architecture="gemma4", gguf_layer_names=GGUF_GEMMA4_NAMES, read_gguf=_gguf_gemma4,
    gguf_top_names=GGUF_GEMMA4_TOP_NAMES, gguf_tensors=_gguf_tensors)
