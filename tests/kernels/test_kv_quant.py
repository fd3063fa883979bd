"""The 8-bit KV spec (inferd/kernels/kv_quant.py): each row's exponent by its rule, exact
dequantization, the write/gather round trip, the reference attention reading 8 bits as the values
they stand for, and the kernel face binding an 8-bit cache's write and read."""

from __future__ import annotations

import pytest
import torch

from inferd.kernels import cpu, kv_quant, ops, reference
from inferd.kernels.kv_quant import EXPONENT_OF_ZERO, FORMATS, QuantizedCache
from inferd.model.layers.rope import Rope

LARGEST = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def least_exponent(amax: float, fmt: str) -> int:
    """The rule written plainly: the least e with amax <= 2**e * largest (float64 is exact here)."""
    e = -127
    while amax > 2.0**e * LARGEST[fmt]:
        e += 1
    return e


def empty_cache(fmt: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> QuantizedCache:
    data = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=torch.uint8).view(FORMATS[fmt][0])
    return QuantizedCache(data, torch.zeros(num_blocks, block_size, kv_heads, dtype=torch.int8))


def test_kv_cache_dtype_names() -> None:
    assert kv_quant.kv_format("auto") is None
    assert kv_quant.kv_format("fp8") == kv_quant.kv_format("fp8_e4m3") == "fp8_e4m3"
    assert kv_quant.kv_format("fp8_e5m2") == "fp8_e5m2"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.kv_format("int8")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_rows_exponent_is_the_least_that_fits_it(fmt: str) -> None:
    """Random magnitudes, and rows whose largest value sits just at, below and above a boundary."""
    gen = torch.Generator().manual_seed(1)
    boundaries = [LARGEST[fmt] * 2.0**k for k in range(-60, 60, 7)]
    amaxes = [b * f for b in boundaries for f in (1.0, 1 - 2**-20, 1 + 2**-20, 0.5, 0.51)]
    amaxes += torch.exp(torch.randn(200, generator=gen, dtype=torch.float64) * 15).tolist()
    amax = torch.tensor(amaxes, dtype=torch.float64)
    rows = torch.randn(len(amaxes), 16, generator=gen, dtype=torch.float64).clamp(-0.9, 0.9) * amax[:, None]
    rows[:, 3] = -amax  # each row's largest magnitude
    rows = rows.float()
    got = kv_quant.exponents_for(rows, fmt)
    expected = [least_exponent(a, fmt) for a in rows.abs().amax(-1).double().tolist()]
    assert got.tolist() == expected


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_rows_largest_code_is_in_the_top_half_and_zero_rows_stay_zero(fmt: str) -> None:
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(500, 64, generator=gen) * torch.exp(torch.randn(500, 1, generator=gen) * 8)
    rows[7] = 0.0
    rows[8, :] = 0.0
    rows[8, 5] = -3.0  # one nonzero element, negative
    codes, exponents = kv_quant.quantize(rows, fmt)
    assert codes.dtype == FORMATS[fmt][0] and exponents.dtype == torch.int8
    top = codes.float().abs().amax(-1)
    nonzero = rows.abs().amax(-1) > 0
    assert ((top >= LARGEST[fmt] / 2) & (top <= LARGEST[fmt]))[nonzero].all()
    assert exponents[7] == EXPONENT_OF_ZERO and not codes[7].float().any()
    assert torch.equal(kv_quant.dequantize(codes[7:8], exponents[7:8], torch.float32), torch.zeros(1, 64))
    assert kv_quant.dequantize(codes[8:9], exponents[8:9], torch.float32)[0, 5] == -3.0  # (a power of two: exact)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_is_exact_in_float32_and_bfloat16(fmt: str) -> None:
    """Every finite code at exponents across the range: float(code) * 2**e, in float64, equals both."""
    codes = torch.arange(256, dtype=torch.uint8).view(FORMATS[fmt][0])
    codes = codes[torch.isfinite(codes.float())]
    exponents = torch.arange(-100, 101, dtype=torch.int8)
    grid_codes = codes[None, :].expand(len(exponents), -1)
    exact = codes.double()[None, :] * torch.pow(2.0, exponents.double())[:, None]
    for dtype in (torch.float32, torch.bfloat16):
        got = kv_quant.dequantize(grid_codes, exponents, dtype)
        assert got.dtype == dtype and torch.equal(got.double(), exact), dtype


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_write_then_gather_round_trips_within_the_formats_rounding(fmt: str) -> None:
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_dim = 6, 4, 2, 32
    key_cache, value_cache = (empty_cache(fmt, num_blocks, block_size, kv_heads, head_dim) for _ in range(2))
    n = 10
    key = torch.randn(n, kv_heads, head_dim, generator=gen) * torch.exp(torch.randn(n, kv_heads, 1, generator=gen) * 4)
    value = torch.randn(n, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    reference.write_kv(key.bfloat16(), value.bfloat16(), key_cache, value_cache, slots)
    mantissa_bits = 3 if fmt == "fp8_e4m3" else 2
    for x, cache in ((key.bfloat16().float(), key_cache), (value.bfloat16().float(), value_cache)):
        back = kv_quant.gather(cache, slots, torch.float32)
        codes, exponents = kv_quant.quantize(x, fmt)
        assert torch.equal(back, kv_quant.dequantize(codes, exponents, torch.float32))
        # half an ulp of the row's top binade at most
        bound = x.abs().amax(-1, keepdim=True) * 2.0 ** -mantissa_bits
        assert ((back - x).abs() <= bound).all()
        # what was read quantizes to itself (a top code rounded down to largest / 2 may take the
        # exponent below, the same values)
        assert torch.equal(kv_quant.dequantize(*kv_quant.quantize(back, fmt), torch.float32), back)
    unwritten = torch.ones(num_blocks * block_size, dtype=torch.bool)
    unwritten[slots] = False
    assert not kv_quant.gather(key_cache, unwritten.nonzero()[:, 0], torch.float32).any()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("softcap,sinks", [(None, None), (5.0, None), (None, [0.5, -1.0, 2.0, 0.0, 1.0, -2.0])],
                         ids=["sdpa", "softcap", "sinks"])
def test_the_reference_reads_8_bits_as_the_values_they_stand_for(fmt: str, softcap: float | None,
                                                                 sinks: list[float] | None) -> None:
    """Prefill and decode over a QuantizedCache equal the same over its dequantized bfloat16 copy, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    num_blocks, block_size, kv_heads, head_dim, heads = 12, 16, 2, 32, 6
    key_cache, value_cache = (empty_cache(fmt, num_blocks, block_size, kv_heads, head_dim) for _ in range(2))
    all_slots = torch.arange(num_blocks * block_size)
    key, value = (torch.randn(len(all_slots), kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2))
    reference.write_kv(key, value, key_cache, value_cache, all_slots)
    plain = [kv_quant.gather(c, all_slots, torch.bfloat16).view(num_blocks, block_size, kv_heads, head_dim)
             for c in (key_cache, value_cache)]
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:5] for _ in range(3)])
    seq_lens, query_lens = torch.tensor([70, 16, 33]), torch.tensor([6, 16, 1])
    query = torch.randn(int(query_lens.sum()), heads, head_dim, generator=gen).bfloat16()
    sink = None if sinks is None else torch.tensor(sinks)
    args = (tables, query_lens, seq_lens, 0.2, None, softcap, sink)
    got = reference.prefill_attention(query, key_cache, value_cache, *args)
    assert torch.equal(got, reference.prefill_attention(query, *plain, *args))
    decode_args = (tables, seq_lens, 0.2, 20, softcap, sink)
    got = reference.decode_attention(query[:3], key_cache, value_cache, *decode_args)
    assert torch.equal(got, reference.decode_attention(query[:3], *plain, *decode_args))


# ------------------------------------------------------------------------------ through the kernel face


LLAMA = ops.LayerShape(hidden_size=576, intermediate_size=1536, head_dim=64, num_heads=9, num_kv_heads=3, eps=1e-5,
                       norm_offset=False, sandwich_norms=False, activation="silu", partial_rotary=False, qk_norm=False)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_face_writes_and_reads_8_bit_caches(backend: str) -> None:
    """layer_ops binds the backend's KV write for an 8-bit cache (not the fused bfloat16 one) and
    each CPU backend's decode reads it as the reference does."""
    if backend == "cpu" and not cpu.available():
        pytest.skip("the CPU kernels did not build (no g++)")
    fmt, cpu_device = "fp8_e4m3", torch.device("cpu")
    attention = ops.select_attention(cpu_device, torch.bfloat16, 9, 3, 64, 16, 8, 1024, kv_format=fmt)
    if backend == "torch":
        attention = ops.TorchAttention(kv_format=fmt)
    assert attention.name == backend and attention.kv_format == fmt
    bound = ops.layer_ops(LLAMA, torch.bfloat16, cpu_device, attention)
    torch.manual_seed(5)
    tokens, heads, kv_heads, dim = 40, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).bfloat16()
    cos, sin = Rope(10000.0, dim).tables(4096, torch.bfloat16)
    key_cache, value_cache = (empty_cache(fmt, 8, 16, kv_heads, dim) for _ in range(2))
    expected_caches = [empty_cache(fmt, 8, 16, kv_heads, dim) for _ in range(2)]
    slots = torch.arange(16, 16 + tokens)  # blocks 1, 2 and part of 3
    q = bound.rope_write_kv(qkv, cos[:tokens], sin[:tokens], key_cache, value_cache, slots)
    expected_q = reference.rope_write_kv(qkv, cos[:tokens], sin[:tokens], *expected_caches, slots, heads, kv_heads)
    assert torch.equal(q, expected_q)
    for got, expected in zip((key_cache, value_cache), expected_caches):
        assert torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8))
        assert torch.equal(got.exponents, expected.exponents)
    plan = attention.plan_decode([[1, 2, 3]], [tokens], 16, cpu_device)
    out = attention.decode(q[-1:], key_cache, value_cache, plan, 0.125)
    want = reference.decode_attention(q[-1:], key_cache, value_cache, torch.tensor([[1, 2, 3]]),
                                      torch.tensor([tokens]), 0.125)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
