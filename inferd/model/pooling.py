"""What a pooling model does after its trunk: the final hidden states of a prompt pooled into one
vector (its last token's, their mean, or the first token's), then sentence-transformers' dense
layers, then scaled to length 1.

    trunk ─ final norm ─ hidden [T, H] ─ pool (last | mean | cls) ─ [H] ─ Dense ... ─ Normalize ─ vector

The engine pools (engine/worker/runner.py: a prompt's rows may come in several chunks, so mean
pooling sums per chunk); `Pooler.project` does the rest, per finished request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

POOLING_METHODS = ("last", "mean", "cls")


@dataclass
class DenseLayer:
    """One sentence-transformers `Dense` module: y = activation(x Wᵀ + b)."""

    weight: torch.Tensor  # [out, in] float32
    bias: torch.Tensor | None  # [out] float32
    activation: str = "identity"  # "identity" or "tanh" (sentence-transformers' default for Dense)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [B, in] -> [B, out]
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.tanh(y) if self.activation == "tanh" else y


@dataclass
class Pooler:
    """How a model's hidden states become one vector; read from the checkpoint (its
    sentence-transformers modules), the family's table, and the settings' [model] keys."""

    method: str  # "last", "mean" or "cls"
    normalize: bool
    dense: list[DenseLayer] = field(default_factory=list)
    matryoshka: bool = False  # its vectors may be cut to a prefix and normalized again
    hidden_size: int = 0

    @property
    def dimensions(self) -> int:
        return self.dense[-1].weight.shape[0] if self.dense else self.hidden_size

    def project(self, pooled: torch.Tensor) -> torch.Tensor:  # [B, hidden] float32 -> [B, dimensions] float32
        """The dense layers, then the normalization, over pooled hidden states."""
        x = pooled.float()
        for layer in self.dense:
            x = layer(x)
        return torch.nn.functional.normalize(x, dim=-1) if self.normalize else x


def load_pooler(folder: str | None, hidden_size: int, method: str | None = None,
                normalize: bool | None = None) -> Pooler:
    """A model's pooler: `method` and `normalize` as the settings say (None: as the checkpoint's
    sentence-transformers modules say, else mean pooling, normalized)."""
    return Pooler(method or "mean", True if normalize is None else normalize, hidden_size=hidden_size)
