"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5 (three of their every four
layers). It keeps no per-token cache: each sequence has one fixed-size state per layer, held in a
state slot (inferd.kernels.linear_attention), which every step reads and leaves updated.

    x ─ in_proj ─┬─ qkv [C] ── causal conv (K taps, SiLU) ─ q, k [Hk, dk], v [Hv, dv] ─┐
                 ├─ b [Hv] ── β = σ(b) ─────────────────────────────────────────────────┤ gated delta rule
                 ├─ a [Hv] ── g = -exp(A_log) · softplus(a + dt_bias) ──────────────────┘       │ o [Hv, dv]
                 └─ z [Hv·dv] ────────────────────────── w · RMSNorm(o) · SiLU(z), per value head ─ out_proj

The rule (l2-normed q and k, q scaled by dk^-0.5, each key head serving Hv/Hk consecutive value
heads) and the conv are the kernel face's ops; g and β are float32, as transformers computes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from inferd.kernels import ops, reference
from inferd.kernels.linear_attention import StatePlan
from inferd.model.layers.linear import Linear, make_linear
from inferd.model.layers.quant import fuse
from inferd.text.errors import ModelLoadError


@dataclass(frozen=True)
class LinearAttention:
    """The linear-attention layers' shapes (ModelConfig.linear_attention)."""

    num_k_heads: int  # Hk: query and key heads
    num_v_heads: int  # Hv: value heads, a whole multiple of Hk
    k_head_dim: int  # dk
    v_head_dim: int  # dv
    conv_kernel: int  # K: the short convolution's taps

    def __post_init__(self) -> None:
        if min(self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim) < 1:
            raise ModelLoadError(f"linear attention with no heads or an empty head: {self}")
        if self.num_v_heads % self.num_k_heads:
            raise ModelLoadError(f"linear attention's {self.num_v_heads} value heads are not a multiple of its "
                                 f"{self.num_k_heads} key heads")
        if self.conv_kernel < 2:
            raise ModelLoadError(f"linear attention's conv kernel of {self.conv_kernel} (at least 2 taps)")

    @property
    def key_size(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_size(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the conv runs over: q, k and v side by side."""
        return 2 * self.key_size + self.value_size

    @property
    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's state per layer: the conv's last K-1 inputs [K-1, C] (model dtype), and
        the delta rule's [Hv, dk, dv] (float32)."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_v_heads, self.k_head_dim, self.v_head_dim)


def expected_tensors(spec: LinearAttention, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
    """The canonical tensors of one layer's Gated DeltaNet and their shapes (decoder.check_shapes)."""
    return {f"{prefix}.qkv": (spec.conv_dim, hidden), f"{prefix}.z": (spec.value_size, hidden),
            f"{prefix}.b": (spec.num_v_heads, hidden), f"{prefix}.a": (spec.num_v_heads, hidden),
            f"{prefix}.conv": (spec.conv_dim, spec.conv_kernel), f"{prefix}.A_log": (spec.num_v_heads,),
            f"{prefix}.dt_bias": (spec.num_v_heads,), f"{prefix}.norm": (spec.v_head_dim,),
            f"{prefix}.out": (hidden, spec.value_size)}


class GatedDeltaNet:
    def __init__(self, spec: LinearAttention, w: dict[str, Any], prefix: str, dtype: torch.dtype, eps: float) -> None:
        self.spec, self.eps = spec, eps
        # (b and a, Hv rows each, stay dense: too few rows to pack, and a packed part would make
        # the fused weight dense)
        self.in_proj = make_linear(fuse([w[f"{prefix}.qkv"], w[f"{prefix}.z"]], dtype), None, dtype,
                                   split=True)  # [C + Hv·dv, hidden]
        self.in_gates = make_linear(fuse([w[f"{prefix}.b"], w[f"{prefix}.a"]], dtype), None, dtype)  # [2 Hv, hidden]
        self.conv = w[f"{prefix}.conv"]  # [C, K]
        self.neg_A = -w[f"{prefix}.A_log"].float().exp()  # [Hv] float32
        self.dt_bias = w[f"{prefix}.dt_bias"].float()  # [Hv]
        self.norm = w[f"{prefix}.norm"]  # [dv]
        self.out = make_linear(w[f"{prefix}.out"], None, dtype, split=True)  # [hidden, Hv·dv]
        self.ops = ops.linear_attention_ops(self.conv.device, dtype, key_head_dim=spec.k_head_dim,
                                            value_head_dim=spec.v_head_dim, conv_size=spec.conv_kernel)

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden], normed
        cache: tuple[torch.Tensor, torch.Tensor],  # conv states [S, K-1, C], states [S, Hv, dk, dv] float32
        plan: StatePlan | None,
        dense_rows: int = 0,
    ) -> torch.Tensor:  # [T, hidden]
        assert plan is not None, "a linear-attention layer without the step's state plan"
        spec, t = self.spec, x.shape[0]
        hv, dv = spec.num_v_heads, spec.v_head_dim
        conv_states, states = cache
        qkv, z = self.in_proj(x, dense_rows).split([spec.conv_dim, spec.value_size], dim=-1)
        b, a = self.in_gates(x).split([hv, hv], dim=-1)
        qkv = self.ops.conv(qkv.contiguous(), self.conv, conv_states, plan)  # [T, C], SiLU applied
        q, k, v = qkv.split([spec.key_size, spec.key_size, spec.value_size], dim=-1)
        # (β in the model's dtype first, as transformers rounds it; g from float32 throughout)
        beta = torch.sigmoid(b).float()  # [T, Hv]
        g = self.neg_A * F.softplus(a.float() + self.dt_bias)  # [T, Hv]
        o = self.ops.delta(q.reshape(t, spec.num_k_heads, spec.k_head_dim),
                           k.reshape(t, spec.num_k_heads, spec.k_head_dim), v.reshape(t, hv, dv), g, beta, states,
                           plan)  # [T, Hv, dv]
        # the gated norm: w · x̂ (plain w, not the model's 1 + w; x̂ rounded first, as Llama's norm
        # rounds it), times SiLU(z) in float32, as transformers' RMSNormGated
        gated = reference.rms_norm(o, self.norm, self.eps) * F.silu(z.reshape(t, hv, dv).float())
        return self.out(gated.to(x.dtype).reshape(t, spec.value_size), dense_rows)

    def linears(self) -> list[Linear]:
        return [self.in_proj, self.in_gates, self.out]
