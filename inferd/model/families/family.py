"""What describes a model family (inferd.model.families.registry): the `Family` record, the tensor
names most families share, and the pieces of config.json every family reads the same way."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from inferd.model.layers.moe import Experts
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
    gguf_top_names: dict[str, str] = field(default_factory=dict)  # the family's own tensors outside the layers
    # the config as the file's tensor names complete it (those only their presence tells: Gemma 4's
    # missing v projections); (config, names) -> config
    gguf_tensors: Callable[[Any, Collection[str]], Any] | None = None
    # tensors holding every expert at once (gpt-oss's [E, ...]): HF suffix -> a function of the
    # tensor and the config giving (canonical suffix, tensor) pairs. (layer_names may name one
    # expert's tensor with "{e}" for its index: "block_sparse_moe.experts.{e}.w1.weight".)
    stacked: dict[str, Callable[[Any, Any], list[tuple[str, Any]]]] = field(default_factory=dict)
    top_names: dict[str, str] = field(default_factory=dict)  # the family's own tensors outside the layers
    # the same tensors stored in MXFP4 (NAME_blocks + NAME_scales), kept packed: HF suffix -> a
    # function of (blocks, scales, keep) giving (canonical suffix, keep(one matrix's blocks, scales))
    microscaled: dict[str, Callable[[Any, Any, Any], list[tuple[str, Any]]]] = field(default_factory=dict)
    # multimodal architectures read as their language model alone: config.json's text_config, the
    # tensors under model.language_model.; the rest of the checkpoint is `skipped`
    multimodal: tuple[str, ...] = ()
    # checkpoint tensors (name prefixes) that are no part of the text model inferd runs: a vision
    # tower, multi-token-prediction layers (transformers ignores these too)
    skipped: tuple[str, ...] = ()
    # GGUF tensors the converter rearranged: GGUF suffix -> a function of (array, config) giving the
    # arrays of the canonical parts gguf_layer_names names for it
    gguf_unpack: dict[str, Callable[[Any, Any], list[Any]]] = field(default_factory=dict)


def sliding_layers(cfg: dict[str, Any], all_sliding: bool) -> dict[str, Any]:
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


def rope_variant(rope: dict[str, Any]) -> dict[str, Any] | None:
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
# a mixture of experts as llama.cpp's converter writes it: every expert in one [E, out, in] tensor
GGUF_EXPERT_NAMES: dict[str, str | tuple[str, ...]] = {
    "ffn_gate_inp.weight": "moe.router",
    "ffn_gate_exps.weight": "moe.experts.{e}.gate",
    "ffn_up_exps.weight": "moe.experts.{e}.up",
    "ffn_down_exps.weight": "moe.experts.{e}.down",
}
GGUF_QK_NORM_NAMES = {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}
GGUF_GEMMA_NAMES = GGUF_LAYER_NAMES | {"post_attention_norm.weight": "post_attn_norm",
                                      "post_ffw_norm.weight": "post_mlp_norm"}
GGUF_PHI3_NAMES = {k: v for k, v in GGUF_LAYER_NAMES.items() if not k.startswith(("attn_q", "attn_k", "attn_v"))} | {
    "attn_qkv.weight": ("q", "k", "v"), "ffn_up.weight": ("gate", "up")}
GGUF_TOP_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}


def gguf_experts(key: Callable[..., Any], common: dict[str, Any], **fields: Any) -> Experts:
    """A GGUF's mixture of experts (llama.cpp's keys), its experts renormalised unless it says not."""
    fields.setdefault("renormalize", bool(key("expert_weights_norm", True)))
    return Experts(num_experts=int(key("expert_count")), top_k=int(key("expert_used_count")),
                   intermediate_size=int(key("expert_feed_forward_length", common["intermediate_size"])), **fields)
