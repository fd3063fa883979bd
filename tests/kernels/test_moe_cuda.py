"""The mixture-of-experts layer's CUDA path (experts stacked, one grouped matmul per product,
nothing read back to the host) on a GPU, against the per-expert products in float32 on the CPU.
Its CPU twin, the same grouped path run on the CPU, is tests/model/test_moe.py."""

from __future__ import annotations

import pytest
import torch

from inferd.model.layers import moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device (tests/model/test_moe.py runs the grouped path on the CPU)")

HIDDEN = 256
SPECS = {
    "mixtral": moe.Experts(num_experts=8, top_k=2, intermediate_size=128),
    "gpt_oss": moe.Experts(num_experts=8, top_k=4, intermediate_size=128, scoring="topk_softmax", router_bias=True,
                           expert_bias=True, activation="swiglu_clamped"),
}


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("family", list(SPECS))
def test_grouped_experts_on_the_gpu_match_the_cpu(family: str) -> None:
    spec = SPECS[family]
    gen = torch.Generator().manual_seed(0)
    # (values bf16 can hold, so that both sides route the same tokens to the same experts)
    weights = {name: (0.05 * torch.randn(shape, generator=gen)).bfloat16().float()
               for name, shape in moe.expected_tensors(spec, "m", HIDDEN).items()}
    act = moe.swiglu_clamped(spec.swiglu_alpha, spec.swiglu_limit) if spec.activation == "swiglu_clamped" else silu_gate
    cpu = moe.MixtureOfExperts(spec, weights, "m", torch.float32, act)
    gpu_weights = {name: w.to("cuda", torch.bfloat16) for name, w in weights.items()}
    gpu = moe.MixtureOfExperts(spec, gpu_weights, "m", torch.bfloat16, act, stacked=True)
    x = torch.randn(37, HIDDEN, generator=gen).bfloat16().float()
    expected = cpu(x)
    got = gpu(x.to("cuda", torch.bfloat16)).float().cpu()
    torch.testing.assert_close(got, expected, rtol=5e-2, atol=5e-2)
    assert int(gpu.routed.sum()) == 37 * spec.top_k


def test_mxfp4_experts_stay_packed_on_the_gpu_and_match_the_cpu() -> None:
    """gpt-oss's experts as a GPU keeps them (MXFP4 bytes, dequantized when routed to)."""
    from inferd.model.layers.linear import Mxfp4Linear
    from inferd.model.layers.mxfp4 import Mxfp4Weight

    spec = SPECS["gpt_oss"]
    gen = torch.Generator().manual_seed(1)
    weights: dict[str, object] = {}
    for name, shape in moe.expected_tensors(spec, "m", HIDDEN).items():
        if len(shape) == 2 and ".experts." in name:
            weights[name] = Mxfp4Weight(torch.randint(0, 256, (shape[0], shape[1] // 32, 16), generator=gen,
                                                      dtype=torch.uint8),
                                        torch.randint(118, 124, (shape[0], shape[1] // 32), generator=gen,
                                                      dtype=torch.uint8))
        else:
            weights[name] = (0.05 * torch.randn(shape, generator=gen)).bfloat16().float()
    act = moe.swiglu_clamped(spec.swiglu_alpha, spec.swiglu_limit)
    cpu = moe.MixtureOfExperts(spec, weights, "m", torch.float32, act)  # type: ignore[arg-type]
    on_gpu = {name: w.to(torch.device("cuda")) if isinstance(w, Mxfp4Weight) else w.to("cuda", torch.bfloat16)  # type: ignore[union-attr]
              for name, w in weights.items()}
    gpu = moe.MixtureOfExperts(spec, on_gpu, "m", torch.bfloat16, act, stacked=True)  # type: ignore[arg-type]
    assert gpu.stacked is None and isinstance(gpu.experts[0].down, Mxfp4Linear)
    x = torch.randn(9, HIDDEN, generator=gen).bfloat16().float()
    torch.testing.assert_close(gpu(x.to("cuda", torch.bfloat16)).float().cpu(), cpu(x), rtol=5e-2, atol=5e-2)
