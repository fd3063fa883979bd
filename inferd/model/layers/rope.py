"""Rotary position embeddings: the inverse frequencies of each variant, and the tables a model
looks up per position.

A variant is a dict in transformers' `rope_parameters` shape (`rope_type` plus its keys); the
same dict may arrive from config.json (`rope_scaling` or `rope_parameters`) or be built from GGUF
metadata. Every variant computes exactly what transformers' `ROPE_INIT_FUNCTIONS` compute, in
float32, because the token-exact tests compare against it:

    default   1 / theta^(2i/d)
    linear    default / factor
    llama3    Llama 3.1: long wavelengths slowed by factor, short kept, the band between blended
    yarn      YaRN: interpolated and extrapolated frequencies ramped by dimension, cos/sin scaled
    longrope  Phi-3: per-frequency divisors (short or long factors), cos/sin scaled
    factors   per-frequency divisors stored in a GGUF's rope_freqs tensor
    proportional  Gemma 4's full layers: the first partial_rotary_factor of the head's frequencies
              (of 1 / theta^(2i/head_dim)) turn, the rest are 0 (those pairs pass unrotated), / factor

`rotary_dim` < head_dim is partial rotary (Phi-4-mini: 0.75 of each head); the rest of the head
passes through unrotated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from inferd.text.errors import ModelLoadError

VARIANTS = ("default", "linear", "llama3", "yarn", "longrope", "factors", "proportional")
# keys of a variant that change nothing in the maths (or are read elsewhere)
_IGNORED_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_KNOWN_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"},
    "longrope": {"short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"},
    "factors": {"factors"},
    "proportional": {"factor"},  # (and its partial_rotary_factor, read here, not as partial rotary)
}


@dataclass(frozen=True)
class Rope:
    """One RoPE table's recipe: base, variant, and how much of each head it rotates."""

    theta: float
    rotary_dim: int  # even; == head_dim unless partial rotary
    scaling: dict[str, Any] | None = None  # a non-default variant's parameters
    max_position_embeddings: int = 4096  # (longrope and yarn derive their factor from it)
    long: bool = False  # longrope: the long factors (the served context passes the original one)

    @property
    def kind(self) -> str:
        scaling = self.scaling or {}
        return str(scaling.get("rope_type", scaling.get("type", "default")))

    def check(self, source: str) -> None:
        """Refuse a variant (or a key of one) whose maths is not implemented: it would change
        every position's rotation, silently."""
        kind = self.kind
        if kind not in VARIANTS:
            raise ModelLoadError(f"{source}: unsupported rope scaling type {kind!r} (supported: {', '.join(VARIANTS)})")
        unknown = set(self.scaling or {}) - _KNOWN_KEYS[kind] - _IGNORED_KEYS
        if unknown:
            raise ModelLoadError(f"{source}: rope scaling {kind!r} has keys inferd does not implement: "
                                 f"{', '.join(sorted(unknown))}")
        if self.rotary_dim % 2:
            raise ModelLoadError(f"{source}: rotary dimension {self.rotary_dim} is odd")

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        """`[rotary_dim // 2]` float32 inverse frequencies and the factor cos/sin are scaled by."""
        dim = self.rotary_dim
        base = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        s = self.scaling or {}
        kind = self.kind
        if kind == "default":
            return base, 1.0
        if kind == "linear":
            return base / float(s["factor"]), 1.0
        if kind == "llama3":
            return _llama3(base, s), 1.0
        if kind == "factors":
            return base / torch.tensor(s["factors"], dtype=torch.float32), 1.0
        if kind == "proportional":  # (rotary_dim is the whole head here)
            turning = int(float(s.get("partial_rotary_factor", 1.0)) * dim // 2)
            base = torch.cat((base[:turning], torch.zeros(dim // 2 - turning)))
            return base / float(s.get("factor", 1.0)), 1.0
        if kind == "yarn":
            return _yarn(self.theta, dim, s, self.max_position_embeddings)
        return _longrope(self.theta, dim, s, self.max_position_embeddings, self.long)

    def tables(self, num_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for every position, `[num_positions, rotary_dim]` each (see inferd.kernels.reference.rotate)."""
        inv_freq, attention_factor = self.inv_freq()
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)  # [P, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, rotary_dim]
        half = self.rotary_dim // 2
        cos = emb.cos() * attention_factor
        signed_sin = torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1) * attention_factor
        return cos.to(dtype), signed_sin.to(dtype)


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low_freq_factor = float(s.get("low_freq_factor", 1.0))
    high_freq_factor = float(s.get("high_freq_factor", 4.0))
    old_context = float(s.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    original = int(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or max_positions / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (no zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(theta: float, dim: int, s: dict[str, Any], max_positions: int, long: bool) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE. transformers switches to the long factors for a whole forward once the
    sequence passes `original_max_position_embeddings`, so positions cached before it keep the short
    rotation; a paged cache cannot re-rotate them. Like vLLM, one table for every position: the long
    factors when the served context is longer than the original one (`long`), else the short."""
    original = int(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or max_positions / original)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = s["long_factor"] if long else s["short_factor"]
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), float(attention_factor)
