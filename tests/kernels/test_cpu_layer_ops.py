"""A decoder layer's fused bfloat16 ops (inferd/kernels/cpu/csrc/cpu_layer_ops.cpp) against their spec
in inferd/kernels/reference.py, and a row's bits alone against the same row in a batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferd.kernels import cpu, reference


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
    _within_one_bf16_step(cpu.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))


def test_add_rms_norm_adds_in_place_and_normalizes() -> None:
    torch.manual_seed(1)
    x, delta = (torch.randn(2, 9, 576) * 2).to(torch.bfloat16).unbind(0)
    weight = torch.rand(576).to(torch.bfloat16)
    expected_sum = x + delta
    normed = cpu.add_rms_norm_(x, delta, weight, 1e-5)
    assert torch.equal(x, expected_sum)
    _within_one_bf16_step(normed, reference.rms_norm(expected_sum, weight, 1e-5))


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


@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 9, 3, 64), (7, 9, 3, 64), (300, 8, 2, 128)])
def test_rope_write_kv_is_rotate_then_write_kv(tokens: int, heads: int, kv_heads: int, dim: int) -> None:
    """Bit for bit the torch code it replaces; a padding row (slot -1) writes nothing."""
    from inferd.kernels.reference import rotate, write_kv
    from inferd.model.layers.rope import Rope

    torch.manual_seed(4)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 3).to(torch.bfloat16)
    cos_table, sin_table = Rope(10000.0, dim).tables(4096, torch.bfloat16)
    positions = torch.randint(0, 4096, (tokens,))
    cos, sin = cos_table[positions], sin_table[positions]
    caches = torch.randn(2, 40, 16, kv_heads, dim).to(torch.bfloat16)  # key and value: [blocks, 16, KV, D] each
    slots = torch.randperm(40 * 16)[:tokens]
    slots[tokens // 2] = -1  # padding
    expected_caches = caches.clone().unbind(0)
    qk = rotate(qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim), cos, sin)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    kept = slots >= 0
    write_kv(qk[kept, heads:], v[kept], *expected_caches, slots[kept])

    key_cache, value_cache = caches.unbind(0)
    q = cpu.rope_write_kv(qkv, cos, sin, key_cache, value_cache, slots, heads, kv_heads)
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(key_cache, expected_caches[0]) and torch.equal(value_cache, expected_caches[1])
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu.rope_write_kv(qkv, cos, sin, key_cache, value_cache, torch.full_like(slots, 40 * 16), heads, kv_heads)
