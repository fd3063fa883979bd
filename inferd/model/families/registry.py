"""The model families inferd serves, each a short description over the decoder's building blocks.

Every family is the Llama decoder (inferd.model.decoder) with some switches set: norm kind,
q/k norms, sandwich norms, MLP activation, embedding scale, attention scale and soft-caps,
sliding-window layers, per-layer RoPE, partial rotary. A family says

- which Hugging Face architectures (config.json's `architectures` / `model_type`) it reads,
- how its config.json sets those switches (`read`: config.json -> ModelConfig fields),
- its tensors' names in a Hugging Face checkpoint (per layer, suffix -> canonical name), and
  which fused tensors split into canonical ones at load (Phi-3's qkv_proj, gate_up_proj),
- the config keys that change the maths which it does not implement (`refuse`): a checkpoint
  setting one is refused with its name rather than served wrong,
- and the same for a GGUF file as llama.cpp's converter writes one: its architecture name,
  tensor names and metadata keys, and the converter's own conventions (Gemma's norms stored as
  1 + w, Llama's q/k rows interleaved for its RoPE, Phi-3's fused tensors).

Adding a family: a `Family(...)` entry below; a new switch goes into ModelConfig, the decoder
and every attention backend (inferd.kernels.ops), with a test that fails with it off.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inferd.model.families.config import ModelConfig
from inferd.text.errors import ModelLoadError

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
    # GGUF (llama.cpp's converter): the general.architecture it writes, its per-layer tensor names
    # (a tuple: a fused tensor's parts), and the metadata -> ModelConfig fields; None: no GGUF
    gguf_architecture: str | None = None
    gguf_layer_names: dict[str, str | tuple[str, ...]] = field(default_factory=dict)
    read_gguf: Callable[[Callable[..., Any], dict[str, Any]], dict[str, Any]] | None = None


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


GGUF_LAYER_NAMES: dict[str, str | tuple[str, ...]] = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
}
GGUF_QK_NORM_NAMES = {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}
GGUF_GEMMA_NAMES = GGUF_LAYER_NAMES | {"post_attention_norm.weight": "post_attn_norm",
                                      "post_ffw_norm.weight": "post_mlp_norm"}
GGUF_PHI3_NAMES = {k: v for k, v in GGUF_LAYER_NAMES.items() if not k.startswith(("attn_q", "attn_k", "attn_v"))} | {
    "attn_qkv.weight": ("q", "k", "v"), "ffn_up.weight": ("gate", "up")}
GGUF_TOP_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}


def _gguf_plain(key: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    return {}


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
GEMMA = {"hidden_activation": "gelu_pytorch_tanh", "use_bidirectional_attention": False}
FAMILIES = (
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM"), ("llama", "mistral"), _llama, refuse=SILU,
           gguf_architecture="llama", gguf_layer_names=GGUF_LAYER_NAMES, read_gguf=_gguf_plain),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), lambda c: _qwen(c, bias=True), refuse=SILU,
           gguf_architecture="qwen2", gguf_layer_names=GGUF_LAYER_NAMES,
           read_gguf=lambda key, common: {"attention_bias": True}),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), lambda c: _qwen(c, bias=False) | {"qk_norm": True},
           layer_names=LLAMA_LAYER_NAMES | QK_NORM_NAMES, refuse=SILU,
           gguf_architecture="qwen3", gguf_layer_names=GGUF_LAYER_NAMES | GGUF_QK_NORM_NAMES,
           read_gguf=lambda key, common: {"qk_norm": True}),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), lambda c: _gemma(c, 2), layer_names=GEMMA_LAYER_NAMES,
           refuse=GEMMA, gguf_architecture="gemma2", gguf_layer_names=GGUF_GEMMA_NAMES, read_gguf=_gguf_gemma(2)),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), lambda c: _gemma(c, 3),
           layer_names=GEMMA_LAYER_NAMES | QK_NORM_NAMES, refuse=GEMMA, gguf_architecture="gemma3",
           gguf_layer_names=GGUF_GEMMA_NAMES | GGUF_QK_NORM_NAMES, read_gguf=_gguf_gemma(3)),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), _phi3,
           fused={"self_attn.qkv_proj.weight": ("q", "k", "v"), "mlp.gate_up_proj.weight": ("gate", "up")},
           refuse={"hidden_act": "silu"}, gguf_architecture="phi3", gguf_layer_names=GGUF_PHI3_NAMES,
           read_gguf=_gguf_phi3),
)
BY_GGUF = {f.gguf_architecture: f for f in FAMILIES if f.gguf_architecture}
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


def gguf_family(meta: dict[str, Any], source: str) -> Family:
    arch = meta.get("general.architecture", "")
    if arch not in BY_GGUF:
        raise ModelLoadError(f"{source}: unsupported architecture {arch!r} in a GGUF (supported: {', '.join(BY_GGUF)})")
    return BY_GGUF[arch]


def config_from_gguf(meta: dict[str, Any], source: str) -> ModelConfig:
    family = gguf_family(meta, source)
    arch = family.gguf_architecture

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{source}: GGUF metadata lacks {arch}.{name}")
        return value

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts: only uniform ones are supported
        if len(set(num_kv_heads)) != 1:
            raise ModelLoadError(f"{source}: per-layer KV head counts are not supported")
        num_kv_heads = num_kv_heads[0]
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"type": "linear", "factor": meta[f"{arch}.rope.scaling.factor"]}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{source}: unsupported rope scaling type {scaling_type!r}")
    tokens = meta.get("tokenizer.ggml.tokens")
    common: dict[str, Any] = dict(
        architecture=family.name,
        vocab_size=int(meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0)),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                     or hidden // num_heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings=False,  # decided by the loader: tied when output.weight is absent
        rope_scaling=rope_scaling,
        name=meta.get("general.name", source),
    )
    assert family.read_gguf is not None
    try:
        return ModelConfig(**(common | family.read_gguf(key, common)))
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from None
