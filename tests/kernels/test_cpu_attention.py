"""Our CPU attention kernels (inferd/kernels/cpu/csrc/: cpu_attention.cpp, decode; cpu_prefill_attention.cpp,
prefill chunks) against their specification, the torch reference: random paged caches, GQA shapes,
contexts across block edges, strided queries; the same over 8-bit caches (inferd/kernels/kv_quant.py),
whose values they read exactly. Prefill rows keep their bits whatever their chunk or batch."""

from __future__ import annotations

import pytest
import torch

from inferd.kernels import cpu, kv_quant, reference
from inferd.kernels.kv_quant import FORMATS, QuantizedCache


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu.available(), "the CPU kernel did not build (make builds it: python -m inferd.kernels.cpu)"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 64), (32, 8, 128), (4, 1, 16), (8, 2, 512)])
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


@pytest.mark.parametrize("window", [None, 700])
def test_long_contexts_split_into_spans_match_the_reference(window: int | None) -> None:
    """Contexts of several 512-position spans (merged in order) and a window that starts mid-span."""
    torch.manual_seed(7)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    lens = [511, 512, 513, 1500, 4100]
    width = -(-max(lens) // block_size)
    key_cache = torch.randn(width * len(lens), block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    value_cache = torch.randn_like(key_cache)
    tables = torch.stack([torch.randperm(width * len(lens))[:width] for _ in lens])
    query = torch.randn(len(lens), heads, head_dim, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens)
    expected = reference.decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.125, window)
    got = cpu.decode_attention(query, key_cache, value_cache, tables.int(), seq_lens.int(), 0.125, window)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_a_long_row_gets_the_same_bits_alone_and_beside_others() -> None:
    """A row's spans come from its own length: its result is the same whatever the batch, which
    also changes how the tasks fall to the threads."""
    torch.manual_seed(3)
    block_size, kv_heads = 16, 3
    key_cache = torch.randn(1200, block_size, kv_heads, 64, dtype=torch.bfloat16)
    value_cache = torch.randn_like(key_cache)
    own_len = 3000
    own = torch.randperm(1200)[: -(-own_len // block_size)].int()
    query = torch.randn(1, 9, 64, dtype=torch.bfloat16)
    alone = cpu.decode_attention(query, key_cache, value_cache, own[None], torch.tensor([own_len], dtype=torch.int32),
                                 0.125)[0]
    for others in ([5], [700, 40, 1], [64] * 31, [2000, 1, 9000 // 2, 513]):
        lens = others + [own_len]
        width = max(-(-n // block_size) for n in lens)
        tables = torch.stack([torch.randint(0, 1200, (width,), dtype=torch.int32) for _ in others]
                             + [torch.nn.functional.pad(own, (0, width - own.numel()))])
        queries = torch.cat([torch.randn(len(others), 9, 64, dtype=torch.bfloat16), query])
        out = cpu.decode_attention(queries, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32),
                                   0.125)
        assert torch.equal(out[-1], alone), others


# ------------------------------------------------------------------------------ 8-bit caches


def quantized_caches(fmt: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                     seed: int) -> tuple[QuantizedCache, QuantizedCache]:
    """Every slot written through the spec (kv_quant.write) from rows of varied magnitudes (about
    the bfloat16 tests' own, whose tolerances these use)."""
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(2):
        data = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=torch.uint8).view(FORMATS[fmt][0])
        caches.append(QuantizedCache(data, torch.zeros(num_blocks, block_size, kv_heads, dtype=torch.int8)))
    n = num_blocks * block_size
    rows = [torch.randn(n, kv_heads, head_dim, generator=gen) * torch.exp(0.5 * torch.randn(n, kv_heads, 1,
                                                                                               generator=gen))
            for _ in range(2)]
    kv_quant.write(rows[0], rows[1], caches[0], caches[1], torch.arange(n))
    return caches[0], caches[1]


def decode_8bit(query: torch.Tensor, key_cache: QuantizedCache, value_cache: QuantizedCache, tables: torch.Tensor,
                seq_lens: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    return cpu.decode_attention_8bit(query, key_cache.data, key_cache.exponents, value_cache.data,
                                     value_cache.exponents, tables.int(), seq_lens.int(), scale, window, softcap, sinks)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (4, 1, 16), (8, 2, 48)])
def test_8bit_decode_matches_the_reference(fmt: str, dtype: torch.dtype, heads: int, kv_heads: int,
                                           head_dim: int) -> None:
    """GQA shapes on the AVX-512 path and (head size 48) the plain one, contexts of several spans."""
    torch.manual_seed(heads * head_dim)
    block_size, num_blocks = 16, 80
    key_cache, value_cache = quantized_caches(fmt, num_blocks, block_size, kv_heads, head_dim, heads * head_dim)
    lens = [1, 15, 17, 100, 513, 37]
    tables = torch.stack([torch.randperm(num_blocks)[: -(-max(lens) // block_size)] for _ in lens])
    query = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, dtype=dtype)[:, :heads]  # (strided rows)
    seq_lens = torch.tensor(lens)
    expected = reference.decode_attention(query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5)
    got = decode_8bit(query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5)
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("window,softcap,sinks", [(5, None, False), (21, 3.0, False), (600, None, True),
                                                  (None, 3.0, True)])
def test_8bit_windowed_capped_and_sunk_decode_matches_the_reference(fmt: str, window: int | None,
                                                                     softcap: float | None, sinks: bool) -> None:
    torch.manual_seed(window or 1)
    heads, kv_heads, head_dim, block_size, num_blocks = 12, 4, 32, 16, 100
    key_cache, value_cache = quantized_caches(fmt, num_blocks, block_size, kv_heads, head_dim, 5)
    lens = [1, 5, 17, 33, 100, 1100]
    tables = torch.stack([torch.randperm(num_blocks)[: -(-max(lens) // block_size)] for _ in lens])
    query = torch.randn(len(lens), heads, head_dim, dtype=torch.bfloat16)
    sink = torch.linspace(-2.0, 4.0, heads) if sinks else None
    args = (tables, torch.tensor(lens), 0.3, window, softcap, sink)
    expected = reference.decode_attention(query, key_cache, value_cache, *args)
    got = decode_8bit(query, key_cache, value_cache, *args)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("head_dim", [64, 48])  # (the AVX-512 path, the plain one)
def test_8bit_values_are_read_exactly(fmt: str, head_dim: int) -> None:
    """A context of one key returns its value: every finite code, at exponents from -127 up, read
    as float(code) * 2**exponent to the bit."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[~torch.isfinite(codes.view(FORMATS[fmt][0]).float())] = 0
    rows = -(-256 // head_dim)
    data = torch.zeros(1, rows, 1, head_dim, dtype=torch.uint8)
    data.view(-1)[:256] = codes
    exponents = torch.zeros(1, rows, 1, dtype=torch.int8)
    for e in (-127, -60, -5, 0, 3, 40, 100):
        exponents.fill_(e)
        cache = QuantizedCache(data.view(FORMATS[fmt][0]), exponents)
        expected = kv_quant.dequantize(cache.data, cache.exponents, torch.float32)  # [1, rows, 1, D]
        for row in range(rows):
            out = decode_8bit(torch.zeros(1, 2, head_dim), cache, cache, torch.tensor([[0]]), torch.tensor([row + 1]),
                              0.1, window=1)
            assert torch.equal(out[0], expected[0, row].expand(2, head_dim)), (e, row)


def test_8bit_long_row_gets_the_same_bits_alone_and_beside_others() -> None:
    torch.manual_seed(3)
    key_cache, value_cache = quantized_caches("fp8_e4m3", 600, 16, 3, 64, 6)
    own_len = 3000
    own = torch.randperm(600)[: -(-own_len // 16)]
    query = torch.randn(1, 9, 64, dtype=torch.bfloat16)
    alone = decode_8bit(query, key_cache, value_cache, own[None], torch.tensor([own_len]), 0.125)[0]
    for others in ([5], [700, 40, 1], [64] * 31):
        lens = others + [own_len]
        width = max(-(-n // 16) for n in lens)
        tables = torch.stack([torch.randint(0, 600, (width,)) for _ in others]
                             + [torch.nn.functional.pad(own, (0, width - own.numel()))])
        queries = torch.cat([torch.randn(len(others), 9, 64, dtype=torch.bfloat16), query])
        out = decode_8bit(queries, key_cache, value_cache, tables, torch.tensor(lens), 0.125)
        assert torch.equal(out[-1], alone), others


def test_8bit_caches_are_checked() -> None:
    key_cache, value_cache = quantized_caches("fp8_e4m3", 2, 16, 2, 32, 7)
    args = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0, 0, 0.0, None)
    query = torch.randn(1, 4, 32)
    with pytest.raises(RuntimeError, match="float8"):
        cpu.decode_attention_8bit(query, key_cache.data, key_cache.exponents, value_cache.data.view(torch.float8_e5m2),
                                  value_cache.exponents, *args)
    with pytest.raises(RuntimeError, match="exponents"):
        cpu.decode_attention_8bit(query, key_cache.data, key_cache.exponents.float(), value_cache.data,
                                  value_cache.exponents, *args)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        cpu.decode_attention_8bit(query.double(), key_cache.data, key_cache.exponents, value_cache.data,
                                  value_cache.exponents, *args)


# ------------------------------------------------------------------------------ prefill chunks

needs_prefill_kernel = pytest.mark.skipif(not cpu.prefill_attention_available(),
                                          reason="the prefill kernel needs AVX512-BF16, which this CPU lacks")


def chunk_batch(lens: list[int], query_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                num_blocks: int, block_size: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 caches and, per sequence, a block table and its chunk's queries (strided rows)."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // block_size)
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    qkv = torch.randn(sum(query_lens), heads + 2 * kv_heads, head_dim, generator=gen).bfloat16()
    return {"query": qkv[:, :heads], "key_cache": key_cache,
            "value_cache": torch.randn(key_cache.shape, generator=gen).bfloat16(),
            "tables": torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens]),
            "seq_lens": torch.tensor(lens), "query_lens": torch.tensor(query_lens)}


def kernel_prefill(b: dict[str, torch.Tensor], scale: float, window: int | None = None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), b["query_lens"].cumsum(0)]).int()
    key_cache, value_cache = b["key_cache"], b["value_cache"]
    common = (b["tables"].int(), b["seq_lens"].int(), starts, scale, window, softcap, sinks)
    if isinstance(key_cache, QuantizedCache):
        return cpu.prefill_attention_8bit(b["query"], key_cache.data, key_cache.exponents, value_cache.data,
                                          value_cache.exponents, *common)
    return cpu.prefill_attention(b["query"], key_cache, value_cache, *common)


def reference_prefill(b: dict[str, torch.Tensor], scale: float, window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The spec in float32: the kernel rounds its weights to bfloat16, as torch's bf16 SDPA does."""
    key_cache, value_cache = b["key_cache"], b["value_cache"]
    if not isinstance(key_cache, QuantizedCache):
        key_cache, value_cache = key_cache.float(), value_cache.float()
    return reference.prefill_attention(b["query"].float(), key_cache, value_cache, b["tables"], b["query_lens"],
                                       b["seq_lens"], scale, window, softcap, sinks)


# sequences with and without a cached prefix, chunks across block and key-tile edges, one of one row
LENS, QUERY_LENS = [40, 700, 1, 33, 97, 160], [40, 300, 1, 5, 64, 97]


@needs_prefill_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 64), (32, 8, 128), (4, 1, 16), (8, 2, 512)])
def test_prefill_chunks_match_the_reference(heads: int, kv_heads: int, head_dim: int) -> None:
    b = chunk_batch(LENS, QUERY_LENS, heads, kv_heads, head_dim, num_blocks=120, seed=heads * head_dim)
    got = kernel_prefill(b, head_dim**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == b["query"].shape
    torch.testing.assert_close(got.float(), reference_prefill(b, head_dim**-0.5), atol=2e-2, rtol=2e-2)


@needs_prefill_kernel
@pytest.mark.parametrize("window,softcap,sinks", [(1, None, False), (5, None, False), (37, 3.0, False),
                                                  (600, None, True), (None, 2.0, True), (None, None, True)])
def test_windowed_capped_and_sunk_prefill_matches_the_reference(window: int | None, softcap: float | None,
                                                                sinks: bool) -> None:
    b = chunk_batch(LENS, QUERY_LENS, 12, 4, 32, num_blocks=100, seed=window or 3)
    sink = torch.linspace(-2.0, 4.0, 12) if sinks else None
    got = kernel_prefill(b, 0.3, window, softcap, sink)
    torch.testing.assert_close(got.float(), reference_prefill(b, 0.3, window, softcap, sink), atol=2e-2, rtol=2e-2)


@needs_prefill_kernel
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("window,sinks", [(None, False), (21, True)])
def test_8bit_prefill_matches_the_reference(fmt: str, window: int | None, sinks: bool) -> None:
    b = chunk_batch(LENS, QUERY_LENS, 9, 3, 64, num_blocks=100, seed=11)
    b["key_cache"], b["value_cache"] = quantized_caches(fmt, 100, 16, 3, 64, 12)
    sink = torch.linspace(-1.0, 3.0, 9) if sinks else None
    got = kernel_prefill(b, 0.125, window, None, sink)
    torch.testing.assert_close(got.float(), reference_prefill(b, 0.125, window, None, sink), atol=2e-2, rtol=2e-2)


@needs_prefill_kernel
@pytest.mark.parametrize("window", [None, 100])
def test_a_prompt_gets_the_same_bits_whole_in_chunks_and_beside_others(window: int | None) -> None:
    """A row's bits depend on its query, position and keys alone: not on its chunk's size or
    start, its place in a task, or the other sequences of the call."""
    prompt = 700
    b = chunk_batch([prompt], [prompt], 9, 3, 64, num_blocks=80, seed=5)
    whole = kernel_prefill(b, 0.125, window)
    for cuts in ([100, 300, 300], [1, 31, 33, 635], [512, 188]):
        done = 0
        for n in cuts:
            part = dict(b, query=b["query"][done:done + n], seq_lens=torch.tensor([done + n]),
                        query_lens=torch.tensor([n]))
            assert torch.equal(kernel_prefill(part, 0.125, window), whole[done:done + n]), (cuts, n)
            done += n
    others = chunk_batch([50, 900, 3], [50, 200, 3], 9, 3, 64, num_blocks=80, seed=6)
    width = max(others["tables"].shape[1], b["tables"].shape[1])
    batch = {"query": torch.cat([others["query"], b["query"][:300]]), "key_cache": b["key_cache"],
             "value_cache": b["value_cache"],
             "tables": torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) % 80
                                  for t in (others["tables"], b["tables"])]),
             "seq_lens": torch.tensor([50, 900, 3, 300]), "query_lens": torch.tensor([50, 200, 3, 300])}
    assert torch.equal(kernel_prefill(batch, 0.125, window)[-300:], whole[:300])


@needs_prefill_kernel
def test_a_prefill_row_agrees_with_decode_of_the_same_row() -> None:
    """The two kernels sum in different orders, so to within rounding, not to the bit."""
    b = chunk_batch([300], [300], 9, 3, 64, num_blocks=30, seed=8)
    rows = kernel_prefill(b, 0.125)
    lens = torch.arange(1, 301, dtype=torch.int32)
    decoded = cpu.decode_attention(b["query"], b["key_cache"], b["value_cache"], b["tables"].int().expand(300, -1),
                                   lens, 0.125)
    torch.testing.assert_close(rows.float(), decoded.float(), atol=2e-2, rtol=2e-2)


@needs_prefill_kernel
def test_prefill_arguments_are_checked_by_name() -> None:
    b = chunk_batch([20], [20], 4, 2, 32, num_blocks=4)
    good = (b["tables"].int(), b["seq_lens"].int(), torch.tensor([0, 20], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu.prefill_attention(b["query"].float(), b["key_cache"], b["value_cache"], *good)
    with pytest.raises(RuntimeError, match="query starts"):
        cpu.prefill_attention(b["query"], b["key_cache"], b["value_cache"], good[0], good[1],
                              torch.tensor([0, 19], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="more query rows than context"):
        cpu.prefill_attention(b["query"], b["key_cache"], b["value_cache"], good[0],
                              torch.tensor([10], dtype=torch.int32), good[2], 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu.prefill_attention(torch.zeros(1, 2, 8, dtype=torch.bfloat16), torch.zeros(1, 16, 1, 8, dtype=torch.bfloat16),
                              torch.zeros(1, 16, 1, 8, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32),
                              torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1.0)
