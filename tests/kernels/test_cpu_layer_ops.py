"""A decoder layer's fused bfloat16 ops (inferd/kernels/csrc/cpu_layer_ops.cpp) against the torch
code they replace in inferd/model/decoder.py, and a row's bits alone against the same row in a batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferd.kernels import cpu
from inferd.model.decoder import RMSNorm


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu.available(), "the CPU kernels did not build (make builds them: python -m inferd.kernels.cpu)"


def _within_one_bf16_step(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal, but for the odd value one bfloat16 rounding away (another order of the same sum)."""
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    step = expected.float().abs().clamp(min=1e-30) * 2**-7
    assert bool(((got.float() - expected.float()).abs() <= step).all())
    assert (got != expected).float().mean().item() < 0.01


def test_rms_norm_is_the_models_rmsnorm() -> None:
    torch.manual_seed(0)
    x = (torch.randn(37, 576) * 3).to(torch.bfloat16)
    x[3, 7] = 200.0  # a massive activation, as real ones have
    weight = torch.rand(576).to(torch.bfloat16)
    _within_one_bf16_step(cpu.rms_norm(x, weight, 1e-5), RMSNorm(weight, 1e-5)(x))


def test_add_rms_norm_adds_in_place_and_normalizes() -> None:
    torch.manual_seed(1)
    x, delta = (torch.randn(2, 9, 576) * 2).to(torch.bfloat16).unbind(0)
    weight = torch.rand(576).to(torch.bfloat16)
    expected_sum = x + delta
    normed = cpu.add_rms_norm_(x, delta, weight, 1e-5)
    assert torch.equal(x, expected_sum)
    _within_one_bf16_step(normed, RMSNorm(weight, 1e-5)(expected_sum))


def test_silu_mul_is_silu_of_the_gate_times_up() -> None:
    torch.manual_seed(2)
    gate_up = (torch.randn(33, 2 * 1536) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    _within_one_bf16_step(cpu.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm_", "silu_mul"])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(op: str) -> None:
    torch.manual_seed(3)
    weight = torch.rand(1536).to(torch.bfloat16)

    def run(rows: torch.Tensor) -> torch.Tensor:
        rows = rows.clone()
        if op == "rms_norm":
            return cpu.rms_norm(rows, weight, 1e-6)
        if op == "add_rms_norm_":
            return cpu.add_rms_norm_(rows, rows * 0.5, weight, 1e-6)
        return cpu.silu_mul(rows)

    row = torch.randn(1, 1536, dtype=torch.bfloat16)
    alone = run(row)[0]
    for batch in (2, 5, 64, 300):  # 300 rows: shared among the threads
        rows = torch.randn(batch, 1536, dtype=torch.bfloat16)
        rows[batch // 3] = row[0]
        assert torch.equal(run(rows)[batch // 3], alone), batch
