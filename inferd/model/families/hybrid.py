"""The hybrid families, Gated DeltaNet among full-attention layers (their decoder:
inferd.model.hybrid): Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, read from config.json as transformers
5.25 reads them (Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig).

    layer_types (or full_attention_interval, default 4)   "linear_attention" / "full_attention"
    linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
    linear_conv_kernel_dim                                  the linear layers' shapes
    head_dim (default 256), rope_parameters.partial_rotary_factor (default 0.25)
    rope_parameters.mrope_section / mrope_interleaved       nothing for text: every section turns by
                                                            the token's position, so M-RoPE is RoPE
    num_experts, num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size,
    norm_topk_prob (Qwen3-Next), decoder_sparse_step, mlp_only_layers (Qwen3-Next)

Fixed by the architecture: norms x̂·(1 + w) (the linear layers' gated norm: w), q/k norms, the
attention output gate, a shared expert behind a sigmoid gate, Qwen3.5-MoE's experts renormalised
in every layer. Qwen3.5's checkpoints are Qwen3_5ForConditionalGeneration: read as the language
model alone (config.json's text_config, tensors under model.language_model.), the vision tower and
the multi-token-prediction layers skipped.

Qwen3-Next fuses its input projections, in_proj_qkvz and in_proj_ba, with every key head's rows
together ([q | k | v | z] per key head, v and z holding that head's Hv/Hk value heads); they are
split at load into Qwen3.5's in_proj_qkv / z / b / a (transformers' fix_query_key_value_ordering).
q_proj gives each head's [query | gate]: split at load into q and q_gate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from inferd.model.families.family import GGUF_EXPERT_NAMES, QK_NORM_NAMES, Family, gguf_experts
from inferd.model.families.sparse import QWEN2_MOE_NAMES
from inferd.model.layers.gated_deltanet import LinearAttention
from inferd.model.layers.moe import Experts
from inferd.text.errors import ModelLoadError

LAYER_NAMES = QK_NORM_NAMES | {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "linear_attn.in_proj_qkv.weight": "linear.qkv",
    "linear_attn.in_proj_z.weight": "linear.z",
    "linear_attn.in_proj_b.weight": "linear.b",
    "linear_attn.in_proj_a.weight": "linear.a",
    "linear_attn.A_log": "linear.A_log",
    "linear_attn.dt_bias": "linear.dt_bias",
    "linear_attn.norm.weight": "linear.norm",
    "linear_attn.out_proj.weight": "linear.out",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
} | {k: v for k, v in QWEN2_MOE_NAMES.items() if v.startswith("moe.")}  # router, experts, shared expert and its gate


def _linear(cfg: Any) -> LinearAttention:
    assert cfg.linear_attention is not None
    return cfg.linear_attention


def _rows(t: torch.Tensor, rows: int, name: str) -> None:
    if t.shape[0] != rows:
        raise ModelLoadError(f"{name} has {t.shape[0]} rows, but the config implies {rows}")


def _query_and_gate(t: torch.Tensor, cfg: Any) -> list[tuple[str, Any]]:
    """q_proj [heads · 2 · head_dim, hidden], each head's [query | gate] -> q, q_gate."""
    _rows(t, 2 * cfg.q_size, "self_attn.q_proj")
    heads = t.reshape(cfg.num_heads, 2, cfg.head_dim, -1)
    return [("q", heads[:, 0].reshape(cfg.q_size, -1)), ("q_gate", heads[:, 1].reshape(cfg.q_size, -1))]


def _conv(t: torch.Tensor, cfg: Any) -> list[tuple[str, Any]]:
    return [("linear.conv", t.reshape(t.shape[0], -1))]  # [C, 1, K] -> [C, K]


def _qkvz(t: torch.Tensor, cfg: Any) -> list[tuple[str, Any]]:
    """Qwen3-Next's in_proj_qkvz, [q | k | v | z] per key head -> in_proj_qkv (q, k, v) and z."""
    spec = _linear(cfg)
    per_head = spec.value_size // spec.num_k_heads
    _rows(t, 2 * spec.key_size + 2 * spec.value_size, "linear_attn.in_proj_qkvz")
    heads = t.reshape(spec.num_k_heads, -1, t.shape[-1])
    q, k, v, z = (x.reshape(-1, t.shape[-1]) for x in
                  heads.split([spec.k_head_dim, spec.k_head_dim, per_head, per_head], dim=1))
    return [("linear.qkv", torch.cat([q, k, v])), ("linear.z", z)]


def _ba(t: torch.Tensor, cfg: Any) -> list[tuple[str, Any]]:
    """Qwen3-Next's in_proj_ba, [b | a] per key head -> b, a."""
    spec = _linear(cfg)
    _rows(t, 2 * spec.num_v_heads, "linear_attn.in_proj_ba")
    b, a = t.reshape(spec.num_k_heads, 2, -1, t.shape[-1]).unbind(1)
    return [("linear.b", b.reshape(spec.num_v_heads, -1)), ("linear.a", a.reshape(spec.num_v_heads, -1))]


# experts stored stacked: gate_up_proj [E, 2I, hidden] (gate rows, then up), down_proj [E, hidden, I]
def _gate_up(t: torch.Tensor, cfg: Any) -> list[tuple[str, Any]]:
    return [(f"moe.experts.{e}.{name}", part.contiguous())
            for e in range(t.shape[0]) for name, part in zip(("gate", "up"), t[e].chunk(2))]


def _down(t: torch.Tensor, cfg: Any) -> list[tuple[str, Any]]:
    return [(f"moe.experts.{e}.down", t[e].contiguous()) for e in range(t.shape[0])]


STACKED = {"self_attn.q_proj.weight": _query_and_gate, "linear_attn.conv1d.weight": _conv,
           "mlp.experts.gate_up_proj": _gate_up, "mlp.experts.down_proj": _down}
NEXT_STACKED = STACKED | {"linear_attn.in_proj_qkvz.weight": _qkvz, "linear_attn.in_proj_ba.weight": _ba}


def _layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    """config.json's layer_types, or (as transformers derives them) every full_attention_interval-th full."""
    n, interval = int(cfg["num_hidden_layers"]), int(cfg.get("full_attention_interval") or 4)
    types = cfg.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                       for i in range(n)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ModelLoadError(f"layer types {unknown} are not supported (supported: full_attention, linear_attention)")
    return tuple("linear" if t == "linear_attention" else "full" for t in types)


def _hybrid(cfg: dict[str, Any], experts: Callable[[dict[str, Any]], Experts | None]) -> dict[str, Any]:
    rope = cfg.get("rope_parameters") or {}
    types = _layer_types(cfg)
    linear = LinearAttention(
        num_k_heads=int(cfg.get("linear_num_key_heads", 16)), num_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        k_head_dim=int(cfg.get("linear_key_head_dim", 128)), v_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)))
    return {"layer_types": types, "linear_attention": linear if "linear" in types else None,
            "attn_output_gate": True, "qk_norm": True, "norm_offset": 1.0, "head_dim": int(cfg.get("head_dim") or 256),
            "partial_rotary_factor": float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
            "experts": experts(cfg)}


def _next_experts(cfg: dict[str, Any]) -> Experts | None:
    """Qwen3-Next: sparse layers as decoder_sparse_step and mlp_only_layers say; top-k renormalised
    unless norm_topk_prob is false."""
    if not int(cfg.get("num_experts") or 0):
        return None
    n, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    return _experts(cfg, renormalize=bool(cfg.get("norm_topk_prob", True)),
                    dense=tuple(i for i in range(n) if i in only_mlp or (i + 1) % step))


def _experts(cfg: dict[str, Any], renormalize: bool = True, dense: tuple[int, ...] = ()) -> Experts:
    return Experts(num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                   intermediate_size=int(cfg["moe_intermediate_size"]), renormalize=renormalize, dense_layers=dense,
                   shared_intermediate_size=int(cfg["shared_expert_intermediate_size"]), shared_gate=True)


# ------------------------------------------------------------------------------ GGUF
# llama.cpp's converter (conversion/qwen.py: Qwen3NextModel; Qwen3.5's classes add
# _LinearAttentionVReorderBase and skip nothing else), what inferd relies on:
# - every norm but the linear layers' gated one stored as 1 + w (so norm_offset 0 here);
# - A_log stored as A = -exp(A_log) (ssm_a, no suffix), dt_bias as ssm_dt.bias, conv1d squeezed to [C, K];
# - Qwen3-Next's in_proj_qkvz written de-interleaved as attn_qkv and attn_gate (z), its
#   in_proj_ba kept interleaved per key head (ssm_ba);
# - Qwen3.5 (Hv > Hk): its value heads reordered from transformers' grouped order (key head h's
#   Hv/Hk heads together) to a tiled one (value head j of every key head together) in attn_qkv's
#   v rows, attn_gate, ssm_beta, ssm_alpha, ssm_a, ssm_dt, ssm_conv1d's v channels and ssm_out's
#   columns: undone here;
# - q_proj as it is (attn_q: each head's [query | gate]);
# - the multi-token-prediction layers as extra blocks after the model's (nextn_predict_layers):
#   skipped by the loader; experts as every GGUF MoE's [E, out, in], the shared one as *_shexp.
GGUF_LAYER_NAMES: dict[str, str | tuple[str, ...]] = {
    "attn_norm.weight": "attn_norm",
    "post_attention_norm.weight": "mlp_norm",
    "attn_q.weight": ("q", "q_gate"),
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_output.weight": "o",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "attn_qkv.weight": "linear.qkv",
    "attn_gate.weight": "linear.z",
    "ssm_a": "linear.A_log",
    "ssm_dt.bias": "linear.dt_bias",
    "ssm_conv1d.weight": "linear.conv",
    "ssm_norm.weight": "linear.norm",
    "ssm_out.weight": "linear.out",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
} | GGUF_EXPERT_NAMES | {
    "ffn_gate_up_exps.weight": ("moe.experts.{e}.gate", "moe.experts.{e}.up"),
    "ffn_gate_inp_shexp.weight": "moe.shared_gate",
    "ffn_gate_shexp.weight": "moe.shared.gate",
    "ffn_up_shexp.weight": "moe.shared.up",
    "ffn_down_shexp.weight": "moe.shared.down",
}
GGUF_QWEN35_NAMES = GGUF_LAYER_NAMES | {"ssm_beta.weight": "linear.b", "ssm_alpha.weight": "linear.a"}
GGUF_NEXT_NAMES = GGUF_LAYER_NAMES | {"ssm_ba.weight": ("linear.b", "linear.a")}


def _gguf_hybrid(key: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    n = common["num_layers"] - int(key("nextn_predict_layers", 0))
    interval = int(key("full_attention_interval", 4))
    head_dim = int(key("attention.key_length"))
    v_heads = int(key("ssm.time_step_rank"))
    linear = LinearAttention(num_k_heads=int(key("ssm.group_count")), num_v_heads=v_heads,
                             k_head_dim=int(key("ssm.state_size")), v_head_dim=int(key("ssm.inner_size")) // v_heads,
                             conv_kernel=int(key("ssm.conv_kernel")))
    experts = None
    if key("expert_count", 0):
        experts = gguf_experts(key, common, shared_intermediate_size=int(key("expert_shared_feed_forward_length")),
                               shared_gate=True)
    types = tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(n))
    return {"num_layers": n, "layer_types": types, "linear_attention": linear if "linear" in types else None,
            "attn_output_gate": True, "qk_norm": True, "norm_offset": 0.0,
            "head_dim": head_dim, "partial_rotary_factor": int(key("rope.dimension_count", head_dim)) / head_dim,
            "experts": experts}


def _np_query_and_gate(w: np.ndarray, cfg: Any) -> list[np.ndarray]:
    heads = w.reshape(cfg.num_heads, 2, cfg.head_dim, -1)
    return [heads[:, 0].reshape(cfg.q_size, -1), heads[:, 1].reshape(cfg.q_size, -1)]


def _np_ba(w: np.ndarray, cfg: Any) -> list[np.ndarray]:
    spec = _linear(cfg)
    b, a = (x.reshape(spec.num_v_heads, -1) for x in np.split(w.reshape(spec.num_k_heads, 2, -1, w.shape[-1]), 2, 1))
    return [b, a]


def _grouped(x: np.ndarray, cfg: Any, size: int, axis: int = 0) -> np.ndarray:
    """Value heads (of `size` entries each along `axis`) from llama.cpp's tiled order back to
    transformers' grouped one: [Hv/Hk, Hk, size] -> [Hk, Hv/Hk, size]."""
    spec = _linear(cfg)
    shape = x.shape
    tiled = x.reshape(*shape[:axis], spec.num_v_heads // spec.num_k_heads, spec.num_k_heads, size, *shape[axis + 1:])
    return np.swapaxes(tiled, axis, axis + 1).reshape(shape)


def _v_rows(x: np.ndarray, cfg: Any) -> np.ndarray:
    """attn_qkv's rows or ssm_conv1d's channels: q and k as they are, v's heads grouped again."""
    spec = _linear(cfg)
    qk = 2 * spec.key_size
    return np.concatenate([x[:qk], _grouped(x[qk:], cfg, spec.v_head_dim)])


def _a_log(a: np.ndarray, cfg: Any) -> np.ndarray:
    return np.log(-a.astype(np.float32))


def _unpack(*steps: Callable[[np.ndarray, Any], np.ndarray]) -> Callable[[np.ndarray, Any], list[np.ndarray]]:
    def unpack(x: np.ndarray, cfg: Any) -> list[np.ndarray]:
        for step in steps:
            x = step(x, cfg)
        return [x]

    return unpack


GGUF_NEXT_UNPACK: dict[str, Callable[[Any, Any], list[Any]]] = {
    "attn_q.weight": _np_query_and_gate, "ssm_ba.weight": _np_ba, "ssm_a": _unpack(_a_log)}
GGUF_QWEN35_UNPACK: dict[str, Callable[[Any, Any], list[Any]]] = {
    "attn_q.weight": _np_query_and_gate,
    "attn_qkv.weight": _unpack(_v_rows),
    "ssm_conv1d.weight": _unpack(_v_rows),
    "attn_gate.weight": _unpack(lambda x, cfg: _grouped(x, cfg, _linear(cfg).v_head_dim)),
    "ssm_out.weight": _unpack(lambda x, cfg: _grouped(x, cfg, _linear(cfg).v_head_dim, axis=1)),
    "ssm_beta.weight": _unpack(lambda x, cfg: _grouped(x, cfg, 1)),
    "ssm_alpha.weight": _unpack(lambda x, cfg: _grouped(x, cfg, 1)),
    "ssm_dt.bias": _unpack(lambda x, cfg: _grouped(x, cfg, 1)),
    "ssm_a": _unpack(lambda x, cfg: _grouped(x, cfg, 1), _a_log),
}

SILU = {"hidden_act": "silu", "attention_bias": False, "attn_output_gate": True, "quantization_config": None}
SKIPPED = ("mtp.", "model.visual.")  # the multi-token-prediction layers, the vision tower
HYBRID_FAMILIES = (
    Family("qwen3_next", ("Qwen3NextForCausalLM",), ("qwen3_next",), lambda c: _hybrid(c, _next_experts),
           layer_names=LAYER_NAMES, stacked=NEXT_STACKED, refuse=SILU, skipped=SKIPPED,
           gguf_architecture="qwen3next", gguf_layer_names=GGUF_NEXT_NAMES, read_gguf=_gguf_hybrid,
           gguf_unpack=GGUF_NEXT_UNPACK),
    Family("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), ("qwen3_5_text", "qwen3_5"),
           lambda c: _hybrid(c, lambda cfg: None), layer_names=LAYER_NAMES, stacked=STACKED, refuse=SILU,
           multimodal=("Qwen3_5ForConditionalGeneration",), skipped=SKIPPED,
           gguf_architecture="qwen35", gguf_layer_names=GGUF_QWEN35_NAMES, read_gguf=_gguf_hybrid,
           gguf_unpack=GGUF_QWEN35_UNPACK),
    Family("qwen3_5_moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
           ("qwen3_5_moe_text", "qwen3_5_moe"), lambda c: _hybrid(c, _experts), layer_names=LAYER_NAMES,
           stacked=STACKED, refuse=SILU, multimodal=("Qwen3_5MoeForConditionalGeneration",), skipped=SKIPPED,
           gguf_architecture="qwen35moe", gguf_layer_names=GGUF_QWEN35_NAMES, read_gguf=_gguf_hybrid,
           gguf_unpack=GGUF_QWEN35_UNPACK),
)
