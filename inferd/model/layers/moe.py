"""The MLPs of a decoder layer: one gated MLP, or a mixture of experts (Mixtral, Qwen3-MoE, gpt-oss, Gemma 4).

A mixture routes each token to `top_k` of its experts and sums their outputs, weighted by the
router (the variants are data, ModelConfig's `Experts`):

    x ──> router ──> weights, experts [T, k]
      └─> rows grouped by expert ──> one product per expert that has rows ──> back in token order
                                                             ──> Σ_k weight_k · y_k  (+ a shared MLP)

Batch-invariant by construction: a token's k outputs are computed by products whose rows do not
depend on one another (linear.py's rule) and summed in the token's own top-k order, so its result
never depends on which other tokens chose the same experts (tests/model/test_moe.py).

On the CPU each expert is its own pair of products (dense, or packed on the block products); on
CUDA the experts are stacked and every product is one grouped matmul (`torch._grouped_mm`) over
all rows, with no read-back to the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inferd.model.layers.linear import DenseLinear, Linear, make_linear
from inferd.model.layers.mxfp4 import Mxfp4Weight
from inferd.model.layers.quant import Weight, fuse
from inferd.text.errors import ModelLoadError

EXPERT_ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_clamped")
SCORINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP as a model's config describes it (ModelConfig.experts): a router
    picks `top_k` of `num_experts` gated MLPs per token, and their outputs are summed, weighted by
    the router."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    # "softmax_topk": softmax over every expert's logit, then the k largest (Mixtral, Qwen3-MoE);
    # "topk_softmax": the k largest logits, then a softmax over those k (gpt-oss)
    scoring: str = "softmax_topk"
    renormalize: bool = True  # softmax_topk: the k weights divided by their sum (Qwen3-MoE's norm_topk_prob)
    router_bias: bool = False  # the router's product has a bias (gpt-oss)
    expert_bias: bool = False  # each expert's gate/up and down products have biases (gpt-oss)
    # "silu" / "gelu_tanh": act(gate) x up; "swiglu_clamped" (gpt-oss): gate capped at `limit`, up
    # clamped to ±limit, then gate·σ(alpha·gate)·(up + 1)
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate_size: int = 0  # a dense MLP every token also goes through (0: none)
    shared_gate: bool = False  # the shared MLP's output scaled by sigmoid(x · w_gate) (Qwen2-MoE style)
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP instead (Qwen3-MoE's mlp_only_layers)
    # Gemma 4: the router's input RMS-normed with this eps (no weight), then times a learned scale
    # [hidden] and hidden^-0.5; None: the router reads its input as it is
    router_norm_eps: float | None = None
    expert_scale: bool = False  # the top-k weights times a learned scale per expert (Gemma 4)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(f"top_k {self.top_k} of {self.num_experts} experts")
        if self.scoring not in SCORINGS:
            raise ModelLoadError(f"unsupported router scoring {self.scoring!r} (supported: {', '.join(SCORINGS)})")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ModelLoadError(f"unsupported expert activation {self.activation!r} "
                                 f"(supported: {', '.join(EXPERT_ACTIVATIONS)})")


Activation = Callable[[torch.Tensor], torch.Tensor]  # [T, 2I] (gate rows, then up rows) -> [T, I]


def route(logits: torch.Tensor, spec: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> each token's expert weights [T, k] float32 and experts [T, k] int64."""
    if spec.scoring == "topk_softmax":  # gpt-oss: the k largest logits, softmaxed among themselves
        top, index = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1).float(), index
    probs = torch.softmax(logits.float(), dim=-1)
    top, index = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, index


def plain_gated(activation: str) -> Activation:
    """act(gate) x up in torch ops: experts whose width the fused CPU kernel does not take."""

    def activate(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
        return act * up

    return activate


def swiglu_clamped(alpha: float, limit: float) -> Activation:
    """gpt-oss's gate: gate capped above at `limit`, up clamped to ±limit, gate·σ(alpha·gate)·(up + 1)."""

    def activate(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up + 1)

    return activate


class GatedMLP:
    """down(act(gate) x up), gate and up fused into one product."""

    def __init__(self, gate_up: Linear, down: Linear, activate: Activation) -> None:
        self.gate_up, self.down, self.activate = gate_up, down, activate

    @classmethod
    def load(cls, w: dict[str, Weight], prefix: str, dtype: torch.dtype, activate: Activation,
             bias: bool = False, split: bool = True) -> GatedMLP:
        """`{prefix}.gate/up/down` (and `_bias`) as a split (or plain) pair of products."""
        gate_up_bias = torch.cat([w[f"{prefix}.gate_bias"], w[f"{prefix}.up_bias"]]) if bias else None
        gate, up = w[f"{prefix}.gate"], w[f"{prefix}.up"]
        fused = Mxfp4Weight.cat([gate, up]) if isinstance(gate, Mxfp4Weight) else fuse([gate, up])  # type: ignore[list-item]
        gate_up = make_linear(fused, gate_up_bias, dtype, split=split)
        down = make_linear(w[f"{prefix}.down"], w[f"{prefix}.down_bias"] if bias else None, dtype, split=split,
                           wide_inputs=True)
        return cls(gate_up, down, activate)  # type: ignore[arg-type]

    def __call__(self, x: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        return self.down(self.activate(self.gate_up(x, dense_rows)), dense_rows)

    def linears(self) -> list[Linear]:
        return [self.gate_up, self.down]


class StackedExperts:
    """Every expert's weights in one tensor per product: a grouped matmul over rows sorted by
    expert (CUDA's path; it runs on the CPU too, where tests check it against the per-expert one).
    The experts' own products are left as views into the stacks: the weights are held once."""

    def __init__(self, experts: list[GatedMLP], activate: Activation) -> None:
        def stack(ops: list[DenseLinear]) -> tuple[torch.Tensor, torch.Tensor | None]:
            weight = torch.stack([op.weight.t() for op in ops]).contiguous()  # [E, in, out]
            bias = torch.stack([op.bias for op in ops]) if ops[0].bias is not None else None  # type: ignore[misc]
            for e, op in enumerate(ops):
                op.weight, op.bias = weight[e].t(), None if bias is None else bias[e]
            return weight, bias

        assert all(isinstance(op, DenseLinear) for e in experts for op in e.linears()), "stacked experts are dense"
        self.gate_up, self.gate_up_bias = stack([e.gate_up for e in experts])  # type: ignore[misc]
        self.down, self.down_bias = stack([e.down for e in experts])  # type: ignore[misc]
        self.activate = activate

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert [R, H], rows per expert [E] -> each row through its expert [R, H]."""
        offsets = counts.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(xs, self.gate_up, offs=offsets)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias.repeat_interleave(counts, dim=0, output_size=xs.shape[0])
        y = torch._grouped_mm(self.activate(h), self.down, offs=offsets)
        if self.down_bias is not None:
            y = y + self.down_bias.repeat_interleave(counts, dim=0, output_size=xs.shape[0])
        return y


class MixtureOfExperts:
    def __init__(self, spec: Experts, w: dict[str, Weight], prefix: str, dtype: torch.dtype, activate: Activation,
                 stacked: bool = False) -> None:
        self.spec = spec
        router = w[f"{prefix}.router"]
        assert isinstance(router, torch.Tensor)
        # (in float32: a few rows of a bf16 product this small cost oneDNN ~80 µs a call, and
        # the experts picked are those of exact logits)
        bias = w.get(f"{prefix}.router_bias")
        self.router = DenseLinear(router.float(), None if bias is None else bias.float())  # type: ignore[union-attr]
        # (packed experts keep no dense copy for long prompts: that would undo the packing of most
        # of the model's bytes)
        self.experts = [GatedMLP.load(w, f"{prefix}.experts.{e}", dtype, activate, spec.expert_bias, split=False)
                        for e in range(spec.num_experts)]
        # (stacked only over dense weights: MXFP4 experts stay one by one, dequantized when routed to)
        dense = all(isinstance(op, DenseLinear) for e in self.experts for op in e.linears())
        self.stacked = StackedExperts(self.experts, activate) if stacked and dense else None
        if self.stacked is not None:  # (the checkpoint's copies go now, not when the whole model is built)
            for name in expected_tensors(spec, prefix, router.shape[1]):
                if ".experts." in name:
                    w.pop(name)
        self.shared = (GatedMLP.load(w, f"{prefix}.shared", dtype, activate) if spec.shared_intermediate_size
                       else None)
        shared_gate = w.get(f"{prefix}.shared_gate")
        self.shared_gate = DenseLinear(shared_gate, None) if isinstance(shared_gate, torch.Tensor) else None
        # Gemma 4: the router's input normed and scaled ([hidden]), the weights scaled per expert ([E])
        self.router_scale = w[f"{prefix}.router_scale"] if spec.router_norm_eps is not None else None
        self.expert_scale = w[f"{prefix}.expert_scale"] if spec.expert_scale else None
        # rows routed to each expert since start, on the device (no read-back per step): operators
        # watch the skew (/metrics)
        self.routed = torch.zeros(spec.num_experts, dtype=torch.int64, device=router.device)

    def __call__(self, x: torch.Tensor, dense_rows: int = 0,
                 router_input: torch.Tensor | None = None) -> torch.Tensor:  # [T, H] -> [T, H]
        """`router_input` [T, H]: what the router reads, where it is not `x` (Gemma 4's residual)."""
        spec = self.spec
        routed = x if router_input is None else router_input
        if self.router_scale is not None:
            routed = self._normed(routed)
        weights, index = route(self.router(routed.float()), spec)  # [T, k] each
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[index]
        slots = index.flatten()  # [T * k]: token t's j-th expert at t * k + j
        order = torch.argsort(slots, stable=True)  # slots grouped by expert, tokens ascending in each
        # (a scatter, not bincount: bincount reads its maximum back from the device)
        counts = torch.zeros(spec.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, slots, torch.ones_like(slots))
        rows = x.index_select(0, order // spec.top_k)  # [T * k, H]
        if self.stacked is not None:
            sorted_out = self.stacked(rows, counts)
        else:
            sorted_out = self._per_expert(rows, counts.tolist())
        self.routed += counts
        out = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
        # Σ_j weight_j · y_j, one small product per token: the same sum whatever the batch
        combined = torch.bmm(weights[:, None, :], out.view(x.shape[0], spec.top_k, -1).float())  # [T, 1, H]
        result = combined[:, 0].to(x.dtype)
        if self.shared is not None:
            shared = self.shared(x, dense_rows)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(x))
            result = result + shared
        return result

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4's router input: RMS-normed in float32 with no weight, times its scale and
        hidden^-0.5 (transformers' Gemma4TextRouter, operation for operation)."""
        assert self.spec.router_norm_eps is not None and self.router_scale is not None
        xf = x.float()
        normed = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.spec.router_norm_eps, -0.5)).to(x.dtype)
        return normed * self.router_scale * x.shape[-1] ** -0.5

    def _per_expert(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs, start = [], 0
        for expert, n in zip(self.experts, counts):
            if n:
                outs.append(expert(rows[start:start + n]))
            start += n
        return torch.cat(outs)

    def linears(self) -> list[Linear]:
        mlps = self.experts + ([self.shared] if self.shared is not None else [])
        return [self.router] + [op for mlp in mlps for op in mlp.linears()]


def expected_tensors(spec: Experts, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
    """The canonical tensors of one layer's mixture and their shapes (decoder.check_shapes)."""
    e, i = spec.num_experts, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.router": (e, hidden)}
    if spec.router_bias:
        shapes[f"{prefix}.router_bias"] = (e,)
    if spec.router_norm_eps is not None:
        shapes[f"{prefix}.router_scale"] = (hidden,)
    if spec.expert_scale:
        shapes[f"{prefix}.expert_scale"] = (e,)
    for n in range(e):
        p = f"{prefix}.experts.{n}"
        shapes |= {f"{p}.gate": (i, hidden), f"{p}.up": (i, hidden), f"{p}.down": (hidden, i)}
        if spec.expert_bias:
            shapes |= {f"{p}.gate_bias": (i,), f"{p}.up_bias": (i,), f"{p}.down_bias": (hidden,)}
    if spec.shared_intermediate_size:
        s = spec.shared_intermediate_size
        shapes |= {f"{prefix}.shared.gate": (s, hidden), f"{prefix}.shared.up": (s, hidden),
                   f"{prefix}.shared.down": (hidden, s)}
        if spec.shared_gate:
            shapes[f"{prefix}.shared_gate"] = (1, hidden)
    return shapes
