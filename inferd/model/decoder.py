"""The decoder every family runs (inferd.model.families.registry): Llama's, with the switches the other
families set, over a paged KV cache.

One forward runs a whole step: the flattened tokens of every sequence (prefill chunks first,
then single decode tokens), their positions, and per-step attention plans built by the runner.
q/k/v and gate/up projections are fused into one matmul each.

The switches (ModelConfig): RMSNorm as x̂·w or x̂·(1 + w); q/k norms per head; sandwich norms
around attention and the MLP; SiLU or GELU-tanh gate; embeddings scaled; attention scale,
logit soft-cap and sliding window per layer; a second RoPE table for sliding layers; partial
rotary; a final-logit soft-cap; an output gate on attention. Gemma 4 runs this model with layers of
its own (inferd.model.gemma4), Qwen3-Next and Qwen3.5 with Gated DeltaNet layers among these
(inferd.model.hybrid).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from inferd.kernels import ops
from inferd.kernels.linear_attention import StatePlan
from inferd.kernels.ops import Attention, AttentionPlan, LayerOps, LayerShape
from inferd.model.families.config import ModelConfig
from inferd.model.layers.gated_deltanet import expected_tensors as linear_tensors
from inferd.model.layers.linear import DenseLinear, Linear, make_linear
from inferd.model.layers.moe import GatedMLP, MixtureOfExperts, expected_tensors, plain_gated, swiglu_clamped
from inferd.model.layers.quant import fuse
from inferd.text.errors import ModelLoadError


@dataclass
class LayerAttention:
    """Where a layer writes and what it attends over, for one step: layers whose KV share block
    tables (a KV group, inferd.engine.kv.groups) share one of these."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (negative: padding, skipped)
    prefill: AttentionPlan | None  # the attention backend's plans (inferd.kernels.ops), the layer's
    decode: AttentionPlan | None  # window in them


@dataclass
class StepAttention:
    """What every layer's attention needs for one step; built once by the runner."""

    layers: list[LayerAttention]  # per layer
    num_prefill_tokens: int  # tokens [0, num_prefill_tokens) are prefill chunks, the rest decodes
    # tokens [0, dense_rows) multiply by packed layers' dense copies (linear.SplitLinear): the
    # prefill rows of long prompts, which the runner puts first
    dense_rows: int = 0
    # the linear-attention layers' segments over the state slots (a hybrid model's; None otherwise)
    state: StatePlan | None = None


@dataclass
class Norm:
    """An RMSNorm's weight as the ops take it: w (Llama's x̂·w), or 1 + w in float32 (Gemma's
    x̂·(1 + w), offset by the family's norm_offset)."""

    weight: torch.Tensor  # [dim]

    @classmethod
    def of(cls, weight: torch.Tensor, offset: float) -> Norm:
        return cls(weight if not offset else offset + weight.float())


class BoundOps:
    """A layer's small ops, which set_attention binds again, and the activation its MLP calls
    through them. The MLP holds this, not the layer: a closure or a bound method of the layer would
    make a cycle, and a dropped model's weights would wait for a full collection to go."""

    def __init__(self, ops: LayerOps) -> None:
        self.ops = ops

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.gated(gate_up)  # (looked up per call: set_attention binds the ops again)


class HasBoundOps:
    """`ops` kept in the layer's BoundOps (`bound`), which its MLP shares."""

    bound: BoundOps

    @property
    def ops(self) -> LayerOps:
        return self.bound.ops

    @ops.setter
    def ops(self, value: LayerOps) -> None:
        if "bound" in self.__dict__:
            self.bound.ops = value
        else:
            self.bound = BoundOps(value)


class DecoderLayer(HasBoundOps):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, attention: Attention,
                 ops: LayerOps, index: int, stacked: bool = False) -> None:
        self.cfg = cfg
        self.attention = attention
        self.ops = ops
        self.index = index
        self.sliding = cfg.is_sliding(index)
        self.attn_norm, self.mlp_norm = self._norm(w, f"{prefix}.attn_norm"), self._norm(w, f"{prefix}.mlp_norm")
        self.post_attn_norm, self.post_mlp_norm = ((self._norm(w, f"{prefix}.post_attn_norm"),
                                                    self._norm(w, f"{prefix}.post_mlp_norm"))
                                                   if cfg.sandwich_norms else (None, None))
        dtype = w[f"{prefix}.attn_norm"].dtype
        self._load_attention(w, prefix, dtype)
        self.mlp = self._mlp(w, prefix, dtype, stacked)

    def _norm(self, w: dict[str, torch.Tensor], name: str) -> Norm:
        return Norm.of(w[name], self.cfg.norm_offset)

    def _load_attention(self, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> None:
        cfg = self.cfg
        self.q_norm, self.k_norm = ((self._norm(w, f"{prefix}.q_norm"), self._norm(w, f"{prefix}.k_norm"))
                                    if cfg.qk_norm else (None, None))
        bias = (
            torch.cat([w[f"{prefix}.q_bias"], w[f"{prefix}.k_bias"], w[f"{prefix}.v_bias"]])
            if cfg.attention_bias
            else None
        )  # [q+2kv] or None
        parts = [w[f"{prefix}.{name}"] for name in ("q", "k", "v")]
        # packed weights: long prompts' prefill rows on a dense copy, the rest packed (linear.SplitLinear).
        # qkv's and down's inputs (the normed residual, SiLU(gate) x up) have outliers inside their
        # blocks of 32: on 8-bit codes each costs the default model ~0.5% of perplexity on the book,
        # so they take 16-bit ones (+0.42% in all, against +1.39%; bench/RESULTS.md, issue 30)
        self.qkv = make_linear(fuse(parts), bias, dtype, split=True, wide_inputs=True)  # [q+2kv, hidden]
        # Qwen3-Next / Qwen3.5: attention's output times σ(gate), the gate q_proj's every other head
        # (split off at load); a product of its own, so that packed q/k/v stay packed (it stays dense)
        self.gate = make_linear(w[f"{prefix}.q_gate"], None, dtype, split=True) if cfg.attn_output_gate else None
        self.o = make_linear(w[f"{prefix}.o"], w.get(f"{prefix}.o_bias"), dtype, split=True)  # [hidden, q]
        self.scale = cfg.attention_scale
        self.softcap = cfg.attn_softcap
        self.sinks = w[f"{prefix}.sinks"].float() if cfg.attention_sinks else None  # [heads]

    def _mlp(self, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype,
             stacked: bool) -> GatedMLP | MixtureOfExperts:
        """The layer's MLP: gated, or a mixture of experts (inferd.model.layers.moe)."""
        gated = self.bound.gated

        spec = self.cfg.experts
        if spec is None or not self.cfg.is_sparse(self.index):
            return GatedMLP.load(w, prefix, dtype, gated)  # type: ignore[arg-type]
        if spec.activation == "swiglu_clamped":
            activate = swiglu_clamped(spec.swiglu_alpha, spec.swiglu_limit)
        else:  # (the fused CPU kernel takes widths of whole 16s)
            activate = gated if spec.intermediate_size % 16 == 0 else plain_gated(spec.activation)
        return MixtureOfExperts(spec, w, f"{prefix}.moe", dtype, activate, stacked)  # type: ignore[arg-type]

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden]: this forward's own (the residual is added into it in place)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin: [T, rotary_dim] each
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, n_kv, head_dim]
        attn: StepAttention,
    ) -> torch.Tensor:
        ops, d = self.ops, attn.dense_rows
        # attention
        out = self._attend(ops.norm(x, self.attn_norm.weight), rope, kv_cache, attn)
        if self.post_attn_norm is not None:
            out = ops.head_norm(out, self.post_attn_norm.weight)
        # mlp: x + out, in place, and the MLP's norm of it
        out = self.mlp(ops.add_norm_(x, out, self.mlp_norm.weight), d)
        if self.post_mlp_norm is not None:
            out = ops.head_norm(out, self.post_mlp_norm.weight)
        return x + out

    def _attend(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], attn: StepAttention) -> torch.Tensor:
        """The normed input [T, hidden] -> attention's output [T, hidden], the new K/V written."""
        cfg, ops = self.cfg, self.ops
        t, p, d = h.shape[0], attn.num_prefill_tokens, attn.dense_rows
        qkv = self.qkv(h, d)  # [T, q + 2 kv]
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        key_cache, value_cache = kv_cache
        plans = attn.layers[self.index]
        q = ops.rope_write_kv(qkv, *rope, key_cache, value_cache, plans.slot_mapping)  # [T, heads, head_dim]
        prefill, decode = plans.prefill, plans.decode
        parts = []
        if prefill is not None:
            parts.append(self.attention.prefill(q[:p], key_cache, value_cache, prefill, self.scale, self.softcap,
                                                self.sinks))
        if decode is not None:
            parts.append(self.attention.decode(q[p:], key_cache, value_cache, decode, self.scale, self.softcap,
                                               self.sinks))
        out = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(t, cfg.q_size)
        if self.gate is not None:
            out = out * torch.sigmoid(self.gate(h, d))
        return self.o(out, d)

    def linears(self) -> list[Linear]:
        gate = [self.gate] if self.gate is not None else []
        return [self.qkv, *gate, self.o, *self.mlp.linears()]

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:  # [T, q + 2 kv] -> the same, q and k heads normed
        """Each q and k head RMS-normed before RoPE (Qwen3, Gemma 3)."""
        assert self.q_norm is not None and self.k_norm is not None
        cfg, t = self.cfg, qkv.shape[0]
        q = self.ops.head_norm(qkv[:, : cfg.q_size].view(t, cfg.num_heads, cfg.head_dim), self.q_norm.weight)
        k = self.ops.head_norm(qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(t, cfg.num_kv_heads, cfg.head_dim),
                               self.k_norm.weight)
        return torch.cat([q.reshape(t, cfg.q_size), k.reshape(t, cfg.kv_size), qkv[:, cfg.q_size + cfg.kv_size :]], 1)


class DecoderModel:
    """The model every family runs; Gemma 4 runs a subclass (inferd.model.gemma4) with its own layers."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self._check(cfg, weights)
        self.cfg = cfg
        self.dtype = dtype
        # the engine sets the device's backend (set_attention) once it knows the cache shape
        self.attention: Attention = ops.TorchAttention()
        self.shape = LayerShape(cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                cfg.rms_norm_eps, bool(cfg.norm_offset) or cfg.norm_float32, cfg.sandwich_norms,
                                cfg.activation, cfg.partial_rotary_factor != 1.0, cfg.qk_norm)
        # (the ops follow the weights as loaded: a norm's dtype and device)
        self.ops_dtype = weights["layers.0.attn_norm"].dtype if cfg.num_layers else dtype
        self.ops = ops.layer_ops(self.shape, self.ops_dtype, weights["norm"].device, self.attention)
        self.min_rows = 1
        self.embed = weights["embed"]  # [vocab, hidden]
        # (Gemma's √hidden, rounded to the weights' dtype as transformers does)
        self.embed_scale = None if cfg.embed_scale == 1.0 else torch.tensor(cfg.embed_scale, dtype=self.embed.dtype)
        # [vocab, hidden]; a tied head has its own entry only when packed (quant.pack_weights)
        self.lm_head = make_linear(weights.get("lm_head", self.embed), None, dtype)
        self.norm = Norm.of(weights["norm"], cfg.norm_offset)
        # experts stacked for grouped products on CUDA, one pair of products each on the CPU (moe.py)
        stacked = weights["norm"].device.type == "cuda"
        self.layers = self._layers(weights, stacked)
        # Rotary tables for every position, computed once like transformers does per forward;
        # sliding layers have their own where the family gives them another RoPE (Gemma 3)
        self.rope = cfg.rope().tables(cfg.max_position_embeddings, dtype)  # cos, signed sin: [max_pos, rotary_dim]
        local = cfg.rope(local=True)
        self.local_rope = (local.tables(cfg.max_position_embeddings, dtype)
                           if cfg.has_sliding_layers and local != cfg.rope() else None)

    def _check(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        check_shapes(cfg, weights)

    def _layers(self, weights: dict[str, torch.Tensor], stacked: bool) -> list[DecoderLayer]:
        return [DecoderLayer(self.cfg, weights, f"layers.{i}", self.attention, self.ops, i, stacked)
                for i in range(self.cfg.num_layers)]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def set_attention(self, attention: Attention) -> None:
        """The attention backend, and the small ops bound again (the KV write is the backend's)."""
        self.attention = attention
        self.ops = ops.layer_ops(self.shape, self.ops_dtype, self.device, attention)
        for layer in self.layers:
            layer.attention, layer.ops = attention, self.ops

    def set_batch_invariant(self, on: bool) -> None:
        """Every row's result the same bits whatever else is in the batch (`linear`; the
        attention backend pads its contexts, select_attention)."""
        self.min_rows = 2 if on else 1
        for op in self.linears():
            for dense in (op, getattr(op, "dense", None)):  # (a SplitLinear's prefill copy)
                if isinstance(dense, DenseLinear):
                    dense.min_rows = self.min_rows

    def linears(self) -> list[Linear]:
        return [op for layer in self.layers for op in layer.linears()] + [self.lm_head]

    def mixtures(self) -> list[MixtureOfExperts | None]:
        """Each layer's mixture of experts, None where its MLP is dense."""
        return [layer.mlp if isinstance(layer.mlp, MixtureOfExperts) else None for layer in self.layers]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        attn: StepAttention,
        logits_indices: torch.Tensor,  # [S] int64: the tokens whose next-token logits are wanted
    ) -> torch.Tensor:  # [S, vocab] float32
        return self.logits(self.trunk(input_ids, positions, kv_caches, attn), logits_indices)

    @torch.inference_mode()
    def trunk(self, input_ids: torch.Tensor, positions: torch.Tensor,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn: StepAttention) -> torch.Tensor:
        """Every layer over the step's tokens: the last layer's output [T, hidden], before the final norm."""
        x = self.embed[input_ids]  # [T, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = self.rope[0][positions], self.rope[1][positions]  # [T, rotary_dim] each
        local = rope if self.local_rope is None else (self.local_rope[0][positions], self.local_rope[1][positions])
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, local if layer.sliding else rope, kv_cache, attn)
        return x

    def hidden(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [S, hidden] float32
        """The final norm's output at `indices`: what the head reads, and what pooling models pool
        (transformers' last_hidden_state)."""
        return self.ops.norm(x[indices], self.norm.weight).float()

    def logits(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [S, vocab]
        x = x[logits_indices]  # [S, hidden]: the final norm and head only where sampled
        x = self.ops.norm(x, self.norm.weight)
        logits = self.lm_head(x).float()
        if self.cfg.final_softcap is not None:
            cap = self.cfg.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


def check_shapes(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> None:
    """Every tensor the config implies is present with the implied shape, and nothing else is
    (a tensor the maths would not use means the config and the checkpoint disagree)."""
    check_tensors(expected_shapes(cfg), w)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    expected: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "norm": (h,)}
    if not cfg.tie_word_embeddings:
        expected["lm_head"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"layers.{n}"
        expected |= {f"{p}.attn_norm": (h,), f"{p}.mlp_norm": (h,)}
        if cfg.is_linear(n):
            assert cfg.linear_attention is not None
            expected |= linear_tensors(cfg.linear_attention, f"{p}.linear", h)
        else:
            expected |= attention_shapes(cfg, p)
        if cfg.is_sparse(n):
            assert cfg.experts is not None
            expected |= expected_tensors(cfg.experts, f"{p}.moe", h)
        else:
            expected |= {f"{p}.gate": (i, h), f"{p}.up": (i, h), f"{p}.down": (h, i)}
        if cfg.sandwich_norms:
            expected |= {f"{p}.post_attn_norm": (h,), f"{p}.post_mlp_norm": (h,)}
    return expected


def attention_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """One attention layer's tensors (`p`: its prefix) and their shapes."""
    h = cfg.hidden_size
    expected = {f"{p}.q": (cfg.q_size, h), f"{p}.k": (cfg.kv_size, h), f"{p}.v": (cfg.kv_size, h),
                f"{p}.o": (h, cfg.q_size)}
    if cfg.attn_output_gate:
        expected[f"{p}.q_gate"] = (cfg.q_size, h)
    if cfg.output_bias:
        expected[f"{p}.o_bias"] = (h,)
    if cfg.attention_sinks:
        expected[f"{p}.sinks"] = (cfg.num_heads,)
    if cfg.attention_bias:
        expected |= {f"{p}.q_bias": (cfg.q_size,), f"{p}.k_bias": (cfg.kv_size,), f"{p}.v_bias": (cfg.kv_size,)}
    if cfg.qk_norm:
        expected |= {f"{p}.q_norm": (cfg.head_dim,), f"{p}.k_norm": (cfg.head_dim,)}
    return expected


def check_tensors(expected: dict[str, tuple[int, ...]], w: dict[str, Any], ignored: Collection[str] = ()) -> None:
    """`expected` (name -> shape) present as said, and nothing else but `ignored` names."""
    for name, shape in expected.items():
        if name not in w:
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint")
        if tuple(w[name].shape) != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(w[name].shape)}, but the config implies {shape}"
            )
    # ("lm_head": a tied head's packed copy, quant.pack_weights)
    unused = sorted(set(w) - set(expected) - set(ignored) - {"lm_head"})
    if unused:
        raise ModelLoadError(f"tensors the config does not use: {', '.join(unused[:5])}"
                             f"{f' and {len(unused) - 5} more' if len(unused) > 5 else ''}")
