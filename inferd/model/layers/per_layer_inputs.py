"""Gemma 4's per-layer inputs (PLE): a second, narrow embedding for every layer, mixed with a
projection of the token's embedding, and fed to each layer after its MLP.

    ids ──> embed [V, L·d] · √d ──────────────────────────┐
    x (the scaled embedding) ──> projection [L·d, H] · H^-½ ─> RMSNorm ─(+)─ · 2^-½ ──> [T, L, d]

    in layer l, after the MLP:
    x ──> gate [d, H] ─> act ─ × input[:, l] ─> projection [H, d] ─> RMSNorm ─(+ x)

Each step is transformers' (Gemma4TextModel.project_per_layer_inputs, Gemma4TextDecoderLayer),
operation for operation: the scales are Python floats, the norms' products float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inferd.model.layers.linear import Linear, make_linear
from inferd.model.layers.quant import Weight

Norm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [..., d], weight [d]) -> normed
Gated = Callable[[torch.Tensor], torch.Tensor]  # [T, 2d] (gate, then up) -> [T, d]: act(gate) x up


class PerLayerInputs:
    """Every layer's input from the step's tokens and their embeddings."""

    def __init__(self, w: dict[str, Weight], num_layers: int, width: int, hidden: int, dtype: torch.dtype) -> None:
        embed = w["per_layer.embed"]
        assert isinstance(embed, torch.Tensor)
        self.embed = embed  # [per-layer vocab, num_layers * width]
        # (√width as a float32 tensor, then rounded to the table's dtype: transformers' ScaledWordEmbedding)
        self.embed_scale = torch.tensor(width ** 0.5).to(embed.dtype)
        self.projection = make_linear(w["per_layer.projection"], None, dtype)  # [num_layers * width, hidden]
        self.projection_scale = hidden ** -0.5
        norm = w["per_layer.norm"]
        assert isinstance(norm, torch.Tensor)
        self.norm = norm.float()  # [width]
        self.num_layers, self.width = num_layers, width

    def __call__(self, ids: torch.Tensor, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        """ids [T], x [T, hidden] (the scaled embedding) -> [T, num_layers, width]."""
        t = ids.shape[0]
        own = (self.embed[ids] * self.embed_scale).view(t, self.num_layers, self.width)
        projected = (self.projection(x) * self.projection_scale).view(t, self.num_layers, self.width)
        return (norm(projected, self.norm) + own) * 2.0 ** -0.5

    def linears(self) -> list[Linear]:
        return [self.projection]


class PerLayerInput:
    """One layer's use of its input: x + norm(projection(act(gate(x)) x input))."""

    def __init__(self, w: dict[str, Weight], prefix: str, dtype: torch.dtype) -> None:
        self.gate = make_linear(w[f"{prefix}.per_layer_gate"], None, dtype)  # [width, hidden]
        self.projection = make_linear(w[f"{prefix}.per_layer_projection"], None, dtype)  # [hidden, width]
        norm = w[f"{prefix}.post_per_layer_norm"]
        assert isinstance(norm, torch.Tensor)
        self.norm = norm.float()  # [hidden]

    def __call__(self, x: torch.Tensor, layer_input: torch.Tensor, gated: Gated, norm: Norm,
                 dense_rows: int = 0) -> torch.Tensor:
        """x [T, hidden], layer_input [T, width] -> [T, hidden]; `gated` is the MLP's act(gate) x up."""
        h = gated(torch.cat((self.gate(x, dense_rows), layer_input), dim=-1))
        return x + norm(self.projection(h, dense_rows), self.norm)

    def linears(self) -> list[Linear]:
        return [self.gate, self.projection]


def expected_tensors(num_layers: int, width: int, vocab: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The per-layer inputs' tensors and their shapes (decoder.check_tensors)."""
    shapes: dict[str, tuple[int, ...]] = {"per_layer.embed": (vocab, num_layers * width),
                                          "per_layer.projection": (num_layers * width, hidden),
                                          "per_layer.norm": (width,)}
    for n in range(num_layers):
        shapes |= {f"layers.{n}.per_layer_gate": (width, hidden), f"layers.{n}.per_layer_projection": (hidden, width),
                   f"layers.{n}.post_per_layer_norm": (hidden,)}
    return shapes
