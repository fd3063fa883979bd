"""Our CPU decode kernel (inferd/kernels/csrc/cpu_attention.cpp) against its specification, the
torch reference: random paged caches, GQA shapes, contexts across block edges, strided queries."""

from __future__ import annotations

import pytest
import torch

from inferd.kernels import cpu, reference


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu.available(), "the CPU kernel did not build (make builds it: python -m inferd.kernels.cpu)"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 64), (32, 8, 128), (4, 1, 16)])
def test_decode_matches_the_reference(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    torch.manual_seed(heads * head_dim)
    block_size, num_blocks = 16, 200
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    lens = [1, 15, 16, 17, 100, 513, 37]
    width = -(-max(lens) // block_size)
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in lens])
    # rows of a wider q/k/v projection, as the model passes them (a strided view)
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, dtype=dtype)
    query = qkv[:, :heads]
    scale = head_dim**-0.5
    seq_lens = torch.tensor(lens)
    expected = reference.decode_attention(query, key_cache, value_cache, tables, seq_lens, scale)
    got = cpu.decode_attention(query, key_cache, value_cache, tables.int(), seq_lens.int(), scale)
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [1, 5, 16, 21, 600])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_windowed_and_capped_decode_matches_the_reference(dtype: torch.dtype, window: int,
                                                          softcap: float | None) -> None:
    """Sliding windows that cut blocks in the middle, match one, or cover every context; GQA 3:1."""
    torch.manual_seed(window)
    heads, kv_heads, head_dim, block_size, num_blocks = 12, 4, 32, 16, 100
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    lens = [1, 5, 17, 33, 100, 513]
    tables = torch.stack([torch.randperm(num_blocks)[: -(-max(lens) // block_size)] for _ in lens])
    query = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    seq_lens = torch.tensor(lens)
    expected = reference.decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.3, window, softcap)
    got = cpu.decode_attention(query, key_cache, value_cache, tables.int(), seq_lens.int(), 0.3, window, softcap)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_a_context_of_one_key_returns_its_value() -> None:
    key_cache = torch.randn(4, 16, 2, 32)
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(1, 4, 32)
    out = cpu.decode_attention(query, key_cache, value_cache, torch.tensor([[2]], dtype=torch.int32),
                               torch.tensor([1], dtype=torch.int32), 0.1)
    assert torch.equal(out[0, :2], value_cache[2, 0, 0].expand(2, 32))
    assert torch.equal(out[0, 2:], value_cache[2, 0, 1].expand(2, 32))


def test_unsupported_shapes_are_refused_by_name() -> None:
    assert not cpu.supports(head_dim=72, num_heads=8, num_kv_heads=8)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu.decode_attention(torch.randn(1, 2, 8), torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8),
                             torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)


def test_loading_the_kernel_leaves_subnormal_floats_alone() -> None:
    """Built without -ffast-math, whose start-up code would set flush-to-zero for the whole process."""
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert tiny.item() != 0.0 and (tiny * 0.5).item() != 0.0
