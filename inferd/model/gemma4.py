"""Gemma 4's decoder (text): the DecoderModel with layers of its own. Gemma 3's layer (sandwich
norms, q/k norms, sliding and full layers with a RoPE each, GELU-tanh) and what Gemma 4 adds, each
a ModelConfig switch read by inferd.model.families.gemma4:

    x ─ norm ─ attention ─ norm ─(+)─┬─ norm ─ MLP ─ [norm] ─────(+)─ norm ─(+)─ per-layer input ─ × scalar
                                     └─ router, norm ─ experts ─ norm ┘ (the MoE block, if any)

- norms x̂·w with the product in float32; attention's scale 1 (the q/k norms set it);
- full layers' own head size and KV heads (global_head_dim, num_global_key_value_heads), and
  their proportional RoPE (rope.py);
- values RMS-normed per head with no weight; on full layers with keys_as_values, the values are
  the k projection's output (before the key's norm and RoPE);
- KV sharing: a layer with another source (ModelConfig.kv_sources) holds no cache (engine/worker/
  kv_cache.py gives it its source's tensors, the runner its source's plans): it projects, norms
  and rotates its queries only, and attends over what its source wrote; it writes nothing;
- a double-wide MLP on KV-shared layers (only the weights' shape says so);
- per-layer inputs (inferd.model.layers.per_layer_inputs); the layer's output times its scalar.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from inferd.kernels import ops, reference
from inferd.kernels.ops import Attention, LayerOps
from inferd.model.decoder import DecoderModel, HasBoundOps, Norm, StepAttention, check_tensors
from inferd.model.families.config import ModelConfig
from inferd.model.layers.linear import Linear, make_linear
from inferd.model.layers.moe import GatedMLP, MixtureOfExperts, expected_tensors
from inferd.model.layers.per_layer_inputs import PerLayerInput, PerLayerInputs
from inferd.model.layers.per_layer_inputs import expected_tensors as per_layer_tensors
from inferd.model.layers.quant import fuse


def _norm(w: dict[str, Any], name: str) -> Norm:
    return Norm(w[name].float())  # (x̂·w in float32: the ops' norms are bound for it, norm_float32)


class MoEBlock:
    """The experts beside the dense MLP: post_norm_1(mlp) + post_norm_2(experts(pre_norm_2(residual))),
    the router reading the residual itself."""

    def __init__(self, cfg: ModelConfig, w: dict[str, Any], prefix: str, dtype: torch.dtype, layer: Gemma4Layer,
                 stacked: bool) -> None:
        assert cfg.experts is not None
        self.mixture = MixtureOfExperts(cfg.experts, w, f"{prefix}.moe", dtype, layer.bound.gated, stacked)
        self.norm, self.post_mlp_norm, self.post_norm = (_norm(w, f"{prefix}.{name}") for name in
                                                         ("moe_norm", "post_mlp_norm_1", "post_moe_norm"))

    def __call__(self, mlp_out: torch.Tensor, residual: torch.Tensor, ops: LayerOps, dense_rows: int) -> torch.Tensor:
        experts = self.mixture(ops.head_norm(residual, self.norm.weight), dense_rows, router_input=residual)
        return ops.head_norm(mlp_out, self.post_mlp_norm.weight) + ops.head_norm(experts, self.post_norm.weight)


class Gemma4Layer(HasBoundOps):
    def __init__(self, cfg: ModelConfig, w: dict[str, Any], index: int, attention: Attention, layer_ops: LayerOps,
                 stacked: bool) -> None:
        p = f"layers.{index}"
        self.cfg, self.index, self.attention, self.ops = cfg, index, attention, layer_ops
        self.sliding = cfg.is_sliding(index)
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads_of(index), cfg.head_dim_of(index)
        self.shared = cfg.kv_source(index) != index  # reads an earlier layer's cache, writes none
        self.keys_as_values = cfg.keys_as_values and not self.sliding
        self.attn_norm, self.post_attn_norm, self.mlp_norm, self.post_mlp_norm, self.q_norm = (
            _norm(w, f"{p}.{name}") for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm"))
        self.k_norm = None if self.shared else _norm(w, f"{p}.k_norm")
        # the value norm's weight: none (ones, so the ops' head norm serves)
        self.ones = torch.ones(self.head_dim, dtype=torch.float32, device=w[f"{p}.attn_norm"].device)
        dtype = w[f"{p}.attn_norm"].dtype
        parts = ("q",) if self.shared else ("q", "k") if self.keys_as_values else ("q", "k", "v")
        self.qkv = make_linear(fuse([w[f"{p}.{n}"] for n in parts]), None, dtype, split=True, wide_inputs=True)
        self.o = make_linear(w[f"{p}.o"], None, dtype, split=True)  # [hidden, heads * head_dim]
        self.mlp = GatedMLP.load(w, p, dtype, self.bound.gated)
        self.moe = MoEBlock(cfg, w, p, dtype, self, stacked) if cfg.experts is not None else None
        self.per_layer = PerLayerInput(w, p, dtype) if cfg.per_layer_input_size else None
        scalar = w[f"{p}.layer_scalar"]  # [1]
        self.scalar = None if bool((scalar == 1).all()) else scalar  # (x · 1 is x: skipped)
        self.scale = cfg.attention_scale


    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden]: this forward's own (the residual is added into it in place)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin: [T, head_dim] each (full width)
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, kv_heads, head_dim]: its source's
        attn: StepAttention,
        layer_input: torch.Tensor | None,  # [T, per_layer_input_size]
    ) -> torch.Tensor:
        ops = self.ops
        t, p, d = x.shape[0], attn.num_prefill_tokens, attn.dense_rows
        # attention
        plans = attn.layers[self.index]
        key_cache, value_cache = kv_cache
        q = self._queries(ops.norm(x, self.attn_norm.weight), rope, key_cache, value_cache, plans.slot_mapping, d)
        parts = []
        if plans.prefill is not None:
            parts.append(self.attention.prefill(q[:p], key_cache, value_cache, plans.prefill, self.scale))
        if plans.decode is not None:
            parts.append(self.attention.decode(q[p:], key_cache, value_cache, plans.decode, self.scale))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = ops.head_norm(self.o(out.reshape(t, self.heads * self.head_dim), d), self.post_attn_norm.weight)
        # mlp (and the experts beside it): x + out in place is the residual
        out = self.mlp(ops.add_norm_(x, out, self.mlp_norm.weight), d)
        if self.moe is not None:
            out = self.moe(out, x, ops, d)
        x = x + ops.head_norm(out, self.post_mlp_norm.weight)
        if self.per_layer is not None:
            assert layer_input is not None
            x = self.per_layer(x, layer_input, self.bound.gated, ops.head_norm, d)
        return x if self.scalar is None else x * self.scalar

    def _queries(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slots: torch.Tensor, dense_rows: int) -> torch.Tensor:
        """The normed, rotated queries [T, heads, head_dim]; keys and values into the cache (unless shared)."""
        ops, t, d = self.ops, h.shape[0], self.head_dim
        q_size, kv_size = self.heads * d, self.kv_heads * d
        qkv = self.qkv(h, dense_rows)  # [T, q (+ kv (+ kv))]
        q = ops.head_norm(qkv[:, :q_size].view(t, self.heads, d), self.q_norm.weight)
        if self.shared:
            return reference.rotate(q, *rope)
        assert self.k_norm is not None
        k = qkv[:, q_size:q_size + kv_size].view(t, self.kv_heads, d)
        v = k if self.keys_as_values else qkv[:, q_size + kv_size:].view(t, self.kv_heads, d)
        if self.cfg.value_norm:
            v = ops.head_norm(v, self.ones)
        k = ops.head_norm(k, self.k_norm.weight)
        qkv = torch.cat([q.reshape(t, q_size), k.reshape(t, kv_size), v.reshape(t, kv_size)], 1)
        return ops.rope_write_kv(qkv, *rope, key_cache, value_cache, slots)

    def linears(self) -> list[Linear]:
        moe = self.moe.mixture.linears() if self.moe is not None else []
        per_layer = self.per_layer.linears() if self.per_layer is not None else []
        return [self.qkv, self.o, *self.mlp.linears(), *moe, *per_layer]


class Gemma4Model(DecoderModel):
    def _check(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        # (a KV-shared layer's own k/v weights, in some checkpoints, are unused: transformers
        # ignores them too, _keys_to_ignore_on_load_unexpected)
        ignored = {f"layers.{i}.{name}" for i in range(cfg.num_layers) if cfg.kv_source(i) != i
                   for name in ("k", "v", "k_norm")}
        check_tensors(expected_shapes(cfg), weights, ignored)

    def _layers(self, weights: dict[str, torch.Tensor], stacked: bool) -> list[Any]:
        cfg = self.cfg
        self.per_layer_inputs = (PerLayerInputs(weights, cfg.num_layers, cfg.per_layer_input_size, cfg.hidden_size,
                                                self.dtype) if cfg.per_layer_input_size else None)
        return [Gemma4Layer(cfg, weights, i, self.attention, self._ops_of(i), stacked) for i in range(cfg.num_layers)]

    def _ops_of(self, layer: int) -> LayerOps:
        """The layer's small ops, bound for its head size and KV heads (the model's own where they agree)."""
        kv_heads, head_dim = self.cfg.kv_shape(layer)
        if (kv_heads, head_dim) == (self.shape.num_kv_heads, self.shape.head_dim):
            return self.ops
        shape = replace(self.shape, num_kv_heads=kv_heads, head_dim=head_dim)
        return ops.layer_ops(shape, self.ops_dtype, self.device, self.attention)

    def set_attention(self, attention: Attention) -> None:
        super().set_attention(attention)
        bound: dict[tuple[int, int], LayerOps] = {}
        for layer in self.layers:
            layer.ops = bound.setdefault(self.cfg.kv_shape(layer.index), self._ops_of(layer.index))

    def linears(self) -> list[Linear]:
        own = self.per_layer_inputs.linears() if self.per_layer_inputs is not None else []
        return [op for layer in self.layers for op in layer.linears()] + own + [self.lm_head]

    def mixtures(self) -> list[MixtureOfExperts | None]:
        return [layer.moe.mixture if layer.moe is not None else None for layer in self.layers]

    @torch.inference_mode()
    def trunk(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (a KV-shared one's: its source's)
        attn: StepAttention,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed[input_ids]  # [T, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        inputs = None if self.per_layer_inputs is None else self.per_layer_inputs(input_ids, x, self.ops.head_norm)
        rope = self.rope[0][positions], self.rope[1][positions]  # [T, full head_dim] each
        local = rope if self.local_rope is None else (self.local_rope[0][positions], self.local_rope[1][positions])
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, local if layer.sliding else rope, kv_cache, attn, None if inputs is None else inputs[:, i])
        return x


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Gemma 4 checkpoint as inferd names them (loader.py), and its shape."""
    h, heads = cfg.hidden_size, cfg.num_heads
    expected: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "norm": (h,)}
    if not cfg.tie_word_embeddings:
        expected["lm_head"] = (cfg.vocab_size, h)
    if cfg.per_layer_input_size:
        expected |= per_layer_tensors(cfg.num_layers, cfg.per_layer_input_size, cfg.per_layer_vocab_size, h)
    for n in range(cfg.num_layers):
        p, (kv_heads, d), i = f"layers.{n}", cfg.kv_shape(n), cfg.intermediate_of(n)
        expected |= {f"{p}.{name}": (h,) for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")}
        expected |= {f"{p}.q": (heads * d, h), f"{p}.o": (h, heads * d), f"{p}.q_norm": (d,), f"{p}.layer_scalar": (1,),
                     f"{p}.gate": (i, h), f"{p}.up": (i, h), f"{p}.down": (h, i)}
        if cfg.kv_source(n) == n:
            expected |= {f"{p}.k": (kv_heads * d, h), f"{p}.k_norm": (d,)}
            if not (cfg.keys_as_values and not cfg.is_sliding(n)):
                expected[f"{p}.v"] = (kv_heads * d, h)
        if cfg.experts is not None:
            expected |= expected_tensors(cfg.experts, f"{p}.moe", h)
            expected |= {f"{p}.{name}": (h,) for name in ("moe_norm", "post_mlp_norm_1", "post_moe_norm")}
    return expected
