"""The model families inferd serves, each a short description over the decoder's building blocks.

Every family is the Llama decoder (inferd.model.decoder) with some switches set: norm kind,
q/k norms, sandwich norms, MLP activation, embedding scale, attention scale and soft-caps,
sliding-window layers, per-layer RoPE, partial rotary. A family says

- which Hugging Face architectures (config.json's `architectures` / `model_type`) it reads,
- how its config.json sets those switches (`read`: config.json -> ModelConfig fields),
- its tensors' names in a Hugging Face checkpoint (per layer, suffix -> canonical name), and
  which fused tensors split into canonical ones at load (Phi-3's qkv_proj, gate_up_proj),
- the config keys that change the maths which it does not implement (`refuse`): a checkpoint
  setting one is refused with its name rather than served wrong.

Adding a family: a `Family(...)` entry below; a new switch goes into ModelConfig, the decoder
and every attention backend (inferd.model.attention), with a test that fails with it off.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inferd.model.config import ModelConfig
from inferd.model.errors import ModelLoadError

Reader = Callable[[dict[str, Any]], dict[str, Any]]

# the Llama layout's per-layer tensors (Llama, Mistral, Qwen2/3, Phi-3 after its fused ones split)
LLAMA_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
QK_NORM_NAMES = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
# Gemma's four norms: post_attention_layernorm is the norm *after* attention here, not the MLP's
GEMMA_LAYER_NAMES = LLAMA_LAYER_NAMES | {
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}
TOP_NAMES = {"embed_tokens.weight": "embed", "norm.weight": "norm", "lm_head.weight": "lm_head"}


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    read: Reader  # config.json -> the family's own ModelConfig fields
    layer_names: dict[str, str] = field(default_factory=lambda: LLAMA_LAYER_NAMES)
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)  # HF suffix -> canonical parts
    refuse: dict[str, object] = field(default_factory=dict)  # key -> the only value implemented


def _window(cfg: dict[str, Any], all_sliding: bool) -> dict[str, Any]:
    """Sliding-window layers from config.json: its `layer_types` where it has them (transformers 5
    writes them), else every layer sliding when `all_sliding` and a window is set (Mistral, Phi-3)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ModelLoadError(f"layer types {unknown} are not supported (supported: full_attention, "
                                 "sliding_attention)")
        return {"layer_types": kinds, "sliding_window": int(window)} if "sliding" in kinds else {}
    if window and all_sliding:
        return {"layer_types": ("sliding",) * int(cfg["num_hidden_layers"]), "sliding_window": int(window)}
    return {}


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    # Mistral: one window for every layer when config.json sets one (null: full attention)
    return {"attention_bias": bool(cfg.get("attention_bias", False)), **_window(cfg, all_sliding=True)}


def _qwen(cfg: dict[str, Any], bias: bool) -> dict[str, Any]:
    # Qwen2/3 window only the layers `layer_types` marks (from max_window_layers), and only with
    # use_sliding_window; shipped checkpoints leave it off
    window = _window(cfg, all_sliding=False) if cfg.get("use_sliding_window") else {}
    return {"attention_bias": bool(cfg.get("attention_bias", bias)), **window}


def _gemma(cfg: dict[str, Any], version: int) -> dict[str, Any]:
    hidden = int(cfg["hidden_size"])
    fields: dict[str, Any] = {
        "norm_offset": 1.0, "sandwich_norms": True, "activation": "gelu_tanh",
        "embed_scale": math.sqrt(hidden),
        "query_scale": float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256) ** -0.5,
        "attn_softcap": cfg.get("attn_logit_softcapping"), "final_softcap": cfg.get("final_logit_softcapping"),
        "attention_bias": bool(cfg.get("attention_bias", False)), **_window(cfg, all_sliding=False),
    }
    if version == 3:
        fields["qk_norm"] = True
        fields["attn_softcap"] = None  # (Gemma 3 keeps the key in its config but does not apply it)
        per_type = cfg.get("rope_parameters") or {}
        if "full_attention" in per_type:  # transformers 5: one RoPE per layer type
            full, local = per_type["full_attention"], per_type.get("sliding_attention") or {}
            fields |= {"rope_theta": float(full.get("rope_theta", 1e6)), "rope_scaling": _variant(full),
                       "local_rope_theta": float(local.get("rope_theta", 10000.0)), "local_rope_scaling": _variant(local)}
        else:  # transformers 4's config.json: rope_theta, rope_local_base_freq, rope_scaling
            fields["local_rope_theta"] = float(cfg.get("rope_local_base_freq", 10000.0))
    return fields


def _phi3(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    fields = {"partial_rotary_factor": partial, **_window(cfg, all_sliding=True)}
    scaling = _variant(rope)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
        # (rope.py's _longrope: the long factors when the context is longer than the original one)
        original = int(scaling.get("original_max_position_embeddings")
                       or cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
        scaling = scaling | {"original_max_position_embeddings": original}
        fields["rope_scaling"] = scaling
    return fields


def _variant(rope: dict[str, Any]) -> dict[str, Any] | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    return None if kind == "default" else dict(rope)


SILU = {"hidden_act": "silu", "mlp_bias": False}
GEMMA = {"hidden_activation": "gelu_pytorch_tanh", "use_bidirectional_attention": False}
FAMILIES = (
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM"), ("llama", "mistral"), _llama, refuse=SILU),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), lambda c: _qwen(c, bias=True), refuse=SILU),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), lambda c: _qwen(c, bias=False) | {"qk_norm": True},
           layer_names=LLAMA_LAYER_NAMES | QK_NORM_NAMES, refuse=SILU),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), lambda c: _gemma(c, 2), layer_names=GEMMA_LAYER_NAMES,
           refuse=GEMMA),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), lambda c: _gemma(c, 3),
           layer_names=GEMMA_LAYER_NAMES | QK_NORM_NAMES, refuse=GEMMA),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), _phi3,
           fused={"self_attn.qkv_proj.weight": ("q", "k", "v"), "mlp.gate_up_proj.weight": ("gate", "up")},
           refuse={"hidden_act": "silu"}),
)
BY_NAME = {f.name: f for f in FAMILIES}


def family_of(cfg: dict[str, Any], source: str) -> Family:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type", "")
    for family in FAMILIES:
        if any(a in family.hf_architectures for a in archs) or model_type in family.model_types:
            return family
    supported = ", ".join(a for f in FAMILIES for a in f.hf_architectures)
    raise ModelLoadError(f"{source}: unsupported architecture {archs or model_type!r} (supported: {supported})")


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    family = family_of(cfg, source)
    for key, implemented in family.refuse.items():
        if key in cfg and cfg[key] not in (implemented, None):
            raise ModelLoadError(f"{source}: config.json sets {key} = {cfg[key]!r}, which inferd does not "
                                 f"implement for {family.name} (only {implemented!r})")
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or {}
        fields: dict[str, Any] = dict(
            architecture=family.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=_variant(cfg.get("rope_scaling") or rope) if "full_attention" not in rope else None,
            name=cfg.get("_name_or_path", "") or source,
        )
        fields |= family.read(cfg)
        if fields["rope_scaling"] is not None and "partial_rotary_factor" in fields["rope_scaling"]:
            fields["partial_rotary_factor"] = float(fields["rope_scaling"]["partial_rotary_factor"])
    except KeyError as e:
        raise ModelLoadError(f"{source}: config.json lacks {e.args[0]!r}") from None
    try:
        return ModelConfig(**fields)
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from None
