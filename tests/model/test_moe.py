"""The mixture-of-experts layer on its own: the routing variants against their formulas, a token's
result independent of the batch around it, and CUDA's grouped path (stacked experts, one grouped
matmul per product) equal to the CPU's per-expert products, run here on the CPU."""

from __future__ import annotations

import pytest
import torch

from inferd.model.layers.moe import Experts
from inferd.model.layers import moe
from inferd.model.layers.linear import BlockLinear, DenseLinear
from inferd.model.layers.quant import Q8Blocks

HIDDEN = 64


def weights(spec: Experts, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = moe.expected_tensors(spec, "m", HIDDEN)
    return {name: (0.2 * torch.randn(shape, generator=gen)).to(dtype) for name, shape in shapes.items()}


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


SPECS = {
    "mixtral": Experts(num_experts=8, top_k=2, intermediate_size=32),
    "qwen2_moe": Experts(num_experts=8, top_k=4, intermediate_size=32, renormalize=False,
                         shared_intermediate_size=48, shared_gate=True),
    "gpt_oss": Experts(num_experts=8, top_k=4, intermediate_size=32, scoring="topk_softmax", router_bias=True,
                       expert_bias=True, activation="swiglu_clamped"),
}


def activation(spec: Experts) -> moe.Activation:
    return moe.swiglu_clamped(spec.swiglu_alpha, spec.swiglu_limit) if spec.activation == "swiglu_clamped" else silu_gate


def test_routing_variants_follow_their_formulas() -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    probs = logits.softmax(-1)
    top, index = probs.topk(2, -1)
    w, i = moe.route(logits, Experts(8, 2, 16))
    assert torch.equal(i, index) and torch.allclose(w, top / top.sum(-1, keepdim=True))
    w, i = moe.route(logits, Experts(8, 2, 16, renormalize=False))
    assert torch.allclose(w, top)
    w, i = moe.route(logits, Experts(8, 2, 16, scoring="topk_softmax"))
    assert torch.allclose(w, logits.topk(2, -1).values.softmax(-1))


def reference(spec: Experts, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, as the formula reads."""
    act = activation(spec)
    logits = x @ w["m.router"].t() + (w["m.router_bias"] if spec.router_bias else 0)
    weights_, index = moe.route(logits, spec)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(spec.top_k):
            p = f"m.experts.{int(index[t, j])}"
            bias = (lambda name: w[f"{p}.{name}_bias"]) if spec.expert_bias else (lambda name: 0)
            gate_up = torch.cat([x[t] @ w[f"{p}.gate"].t() + bias("gate"), x[t] @ w[f"{p}.up"].t() + bias("up")])
            out[t] += weights_[t, j] * (act(gate_up[None])[0] @ w[f"{p}.down"].t() + bias("down"))
    if spec.shared_intermediate_size:
        gate_up = torch.cat([x @ w["m.shared.gate"].t(), x @ w["m.shared.up"].t()], -1)
        out += torch.sigmoid(x @ w["m.shared_gate"].t()) * (act(gate_up) @ w["m.shared.down"].t())
    return out


@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "grouped"])
def test_the_layer_equals_the_formula(family: str, stacked: bool) -> None:
    spec = SPECS[family]
    w = weights(spec)
    layer = moe.MixtureOfExperts(spec, dict(w), "m", torch.float32, activation(spec), stacked=stacked)
    x = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(layer(x), reference(spec, w, x), rtol=1e-5, atol=1e-5)
    assert int(layer.routed.sum()) == 23 * spec.top_k


def batch_invariant(layer: moe.MixtureOfExperts) -> None:
    for op in layer.linears():
        if isinstance(op, DenseLinear):
            op.min_rows = 2  # (what DecoderModel.set_batch_invariant sets)


def assert_one_row_is_the_same_in_every_batch(layer: moe.MixtureOfExperts, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(1, HIDDEN, generator=gen).to(dtype)
    alone = layer(row)
    for n in (2, 3, 7, 16, 33, 64):
        others = torch.randn(n - 1, HIDDEN, generator=gen).to(dtype)
        at = n // 2
        batch = torch.cat([others[:at], row, others[at:]])
        assert torch.equal(layer(batch)[at], alone[0]), f"row changed in a batch of {n}"


@pytest.mark.parametrize("family", list(SPECS))
def test_a_token_never_depends_on_the_batch_around_it(family: str) -> None:
    spec = SPECS[family]
    layer = moe.MixtureOfExperts(spec, weights(spec, dtype=torch.bfloat16), "m", torch.bfloat16, activation(spec))
    batch_invariant(layer)
    assert_one_row_is_the_same_in_every_batch(layer, torch.bfloat16)


def test_packed_experts_on_the_block_products_are_batch_invariant_too() -> None:
    if not BlockLinear.fits((64, 64)):
        pytest.skip("this CPU does not run the block products (AVX-512 VNNI)")
    spec = SPECS["gpt_oss"]
    w: dict[str, object] = dict(weights(spec, dtype=torch.bfloat16))
    gen = torch.Generator().manual_seed(4)
    for name in list(w):
        if name.rsplit(".", 1)[-1] in ("gate", "up", "down") and ".experts." in name:
            rows, cols = w[name].shape  # type: ignore[union-attr]
            w[name] = Q8Blocks(torch.randint(-12, 13, (rows, cols), generator=gen, dtype=torch.int8),
                               torch.full((rows, cols // 32), 2.0**-5))
    layer = moe.MixtureOfExperts(spec, w, "m", torch.bfloat16, activation(spec))  # type: ignore[arg-type]
    assert all(isinstance(op, BlockLinear) for e in layer.experts for op in e.linears())
    batch_invariant(layer)
    assert_one_row_is_the_same_in_every_batch(layer, torch.bfloat16)
