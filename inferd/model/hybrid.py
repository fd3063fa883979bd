"""Qwen3-Next's and Qwen3.5's decoder: the DecoderModel's layers, with Gated DeltaNet (linear
attention, inferd.model.layers.gated_deltanet) in place of attention in the layers that
ModelConfig.layer_types marks "linear" (three of every four; every fourth is full attention):

    linear:  x ─ norm ─ Gated DeltaNet ─(+)─ norm ─ MLP or experts ─(+)
    full:    x ─ norm ─ attention · σ(gate) ─(+)─ norm ─ MLP or experts ─(+)

Norms are x̂·(1 + w); full attention has q/k norms, partial rotary (RoPE over the first quarter of
each head) and its output gate (ModelConfig.attn_output_gate); the experts have a shared expert
behind a sigmoid gate. A linear layer's `kv_caches` entry is its state: (conv states
[S, K-1, C], delta-rule states [S, Hv, dk, dv] float32) over the S state slots, and the step's
StepAttention.state says which slot each sequence reads and leaves its state in.
"""

from __future__ import annotations

from typing import Any

import torch

from inferd.model.decoder import DecoderLayer, DecoderModel, StepAttention
from inferd.model.layers.gated_deltanet import GatedDeltaNet
from inferd.model.layers.linear import Linear


class LinearAttentionLayer(DecoderLayer):
    """A decoder layer whose attention is Gated DeltaNet (canonical tensors `layers.{i}.linear.*`)."""

    def _load_attention(self, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> None:
        assert self.cfg.linear_attention is not None
        self.mixer = GatedDeltaNet(self.cfg.linear_attention, w, f"{prefix}.linear", dtype, self.cfg.rms_norm_eps)

    def _attend(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], attn: StepAttention) -> torch.Tensor:
        return self.mixer(h, kv_cache, attn.state, attn.dense_rows)

    def linears(self) -> list[Linear]:
        return [*self.mixer.linears(), *self.mlp.linears()]


class HybridModel(DecoderModel):
    def _layers(self, weights: dict[str, torch.Tensor], stacked: bool) -> list[Any]:
        return [(LinearAttentionLayer if self.cfg.is_linear(i) else DecoderLayer)(
            self.cfg, weights, f"layers.{i}", self.attention, self.ops, i, stacked) for i in range(self.cfg.num_layers)]
