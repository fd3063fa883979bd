"""Attention sinks (gpt-oss) on every attention backend, against the formula written out densely.

A sink is one learned logit per query head that joins the softmax's denominator and has no value:
for a query row, head h and scores s_j (scaled, then soft-capped where a cap is set),

    out = Σ_j exp(s_j - m) v_j / (Σ_j exp(s_j - m) + exp(sinks[h] - m)),   m = max(max_j s_j, sinks[h])

as transformers' gpt-oss eager attention computes it: the sink concatenated as one more column,
the row's max subtracted, softmax, the column dropped. Checked here with and without a sliding
window and a soft-cap, GQA 4:2, ragged sequences over shuffled blocks of 16:
- the reference (prefill with several query rows per sequence, and decode) against the formula;
- our CPU decode kernel against the reference and the formula (one span and several);
- the CUDA decode kernels, compiled for the CPU emulation, single pass and split (the sink enters
  once, in the combine), against the reference and the formula; on a GPU the same through CuPy.
"""

from __future__ import annotations

import pytest
import torch

import cuda_emulator
from inferd.kernels import cpu, ops, reference
from inferd.kernels.cuda import launch as cuda

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 64, 16
SCALE = HEAD_DIM**-0.5
SINKS = torch.tensor([-1.5, 0.5, 2.5, 6.0])  # [HEADS] float32: from barely felt to most of the weight
LENS = [1, 17, 40, 300]  # a lone token, across block edges, past one 128-token partition
QUERY_LENS = [1, 5, 16, 9]  # prefill: the last query_len positions of each context
WINDOW = 20  # cuts blocks in the middle, and slides within a prefill chunk
VARIANTS = [(None, None), (WINDOW, None), (None, 3.0), (WINDOW, 3.0)]
VARIANT_IDS = ["full", "window", "cap", "window-cap"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
GARBAGE = 30.0  # unowned cache slots: a kernel that reads one gets a visibly wrong answer


def paged(lens: list[int], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """K/V caches [blocks, BLOCK, KV_HEADS, HEAD_DIM] with each sequence in shuffled blocks, garbage
    elsewhere, and block tables [N][width] whose unused columns point at random blocks."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.randint(0, num_blocks, (len(lens), max(needed) + 1), generator=gen)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key_cache, value_cache = (GARBAGE * torch.randn(shape, generator=gen) for _ in range(2))
    for s, n in enumerate(lens):
        tables[s, : needed[s]] = torch.tensor([order.pop() for _ in range(needed[s])])
        positions = torch.arange(n)
        slots = tables[s, positions // BLOCK] * BLOCK + positions % BLOCK
        reference.write_kv(torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen),
                           torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen), key_cache, value_cache, slots)
    return key_cache.to(dtype), value_cache.to(dtype), tables.tolist()


def dense(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: list[list[int]],
          lens: list[int], query_lens: list[int], window: int | None, softcap: float | None,
          sinks: torch.Tensor | None) -> torch.Tensor:
    """The formula, one sequence at a time in float64: query [T, H, D] -> [T, H, D] float32."""
    group = HEADS // KV_HEADS
    outs, row = [], 0
    for table, n, q_len in zip(tables, lens, query_lens):
        positions = torch.arange(n)
        slots = torch.tensor(table)[positions // BLOCK] * BLOCK + positions % BLOCK
        k = key_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = value_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [L, H, D]
        q = query[row : row + q_len].double()  # [Q, H, D]
        scores = torch.einsum("qhd,lhd->hql", q, k) * SCALE  # [H, Q, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(n - q_len, n)[:, None]  # [Q, 1]
        allowed = (positions[None, :] <= q_pos) & ((q_pos - positions[None, :] < window) if window else True)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # transformers' gpt-oss: concat the sink, subtract the max, softmax, drop it
            column = sinks.double()[:, None, None].expand(HEADS, q_len, 1)
            combined = torch.cat([scores, column], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = torch.softmax(combined, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hql,lhd->qhd", probs, v))
        row += q_len
    return torch.cat(outs).float()


def close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def differs(got: torch.Tensor, without: torch.Tensor) -> None:
    """The sinks matter: far more than any tolerance here."""
    assert (got.float() - without.float()).abs().max().item() > 0.05


def check_decode(backend: ops.Attention, dtype: torch.dtype, lens: list[int], window: int | None,
                 softcap: float | None, seed: int) -> None:
    """backend.decode with sinks against the formula and the reference; without sinks, the reference."""
    key_cache, value_cache, tables = paged(lens, dtype, seed)
    query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)
    plan = backend.plan_decode(tables, lens, BLOCK, torch.device("cpu"), window)
    got = backend.decode(query, key_cache, value_cache, plan, SCALE, softcap, SINKS)
    assert got.dtype == dtype and got.shape == query.shape
    close(got, dense(query, key_cache, value_cache, tables, lens, [1] * len(lens), window, softcap, SINKS), dtype)
    expected = reference.decode_attention(query.float(), key_cache.float(), value_cache.float(), torch.tensor(tables),
                                          torch.tensor(lens), SCALE, window, softcap, SINKS)
    close(got, expected, dtype)
    without = backend.decode(query, key_cache, value_cache, plan, SCALE, softcap)
    close(without, reference.decode_attention(query.float(), key_cache.float(), value_cache.float(),
                                              torch.tensor(tables), torch.tensor(lens), SCALE, window, softcap), dtype)
    differs(got, without)


# ------------------------------------------------------------------------------ the reference


@pytest.mark.parametrize("window,softcap", VARIANTS, ids=VARIANT_IDS)
def test_reference_prefill_matches_the_formula(window: int | None, softcap: float | None) -> None:
    """Several query rows per sequence (chunks continuing a cached prefix), through the plan."""
    backend = ops.TorchAttention()
    key_cache, value_cache, tables = paged(LENS, torch.float32, 1)
    query = torch.randn(sum(QUERY_LENS), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2))  # [T, H, D]
    plan = backend.plan_prefill(tables, LENS, QUERY_LENS, BLOCK, torch.device("cpu"), window)
    got = backend.prefill(query, key_cache, value_cache, plan, SCALE, softcap, SINKS)
    close(got, dense(query, key_cache, value_cache, tables, LENS, QUERY_LENS, window, softcap, SINKS), torch.float32)
    direct = reference.prefill_attention(query, key_cache, value_cache, torch.tensor(tables), torch.tensor(QUERY_LENS),
                                         torch.tensor(LENS), SCALE, window, softcap, SINKS)
    assert torch.equal(got, direct)
    without = backend.prefill(query, key_cache, value_cache, plan, SCALE, softcap)
    close(without, dense(query, key_cache, value_cache, tables, LENS, QUERY_LENS, window, softcap, None),
          torch.float32)
    differs(got, without)


@pytest.mark.parametrize("window,softcap", VARIANTS, ids=VARIANT_IDS)
def test_reference_decode_matches_the_formula(window: int | None, softcap: float | None) -> None:
    check_decode(ops.TorchAttention(), torch.float32, LENS, window, softcap, seed=3)


def test_a_sink_at_minus_infinity_weighs_nothing() -> None:
    key_cache, value_cache, tables = paged(LENS, torch.float32, 4)
    query = torch.randn(sum(QUERY_LENS), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    args = (query, key_cache, value_cache, torch.tensor(tables), torch.tensor(QUERY_LENS), torch.tensor(LENS), SCALE)
    close(reference.prefill_attention(*args, WINDOW, None, torch.full((HEADS,), float("-inf"))),
          reference.prefill_attention(*args, WINDOW), torch.float32)


# ------------------------------------------------------------------------------ our CPU kernel

needs_cpu_kernel = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels did not build (no g++)")


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window,softcap", [*VARIANTS, (700, None)], ids=[*VARIANT_IDS, "window700"])
def test_cpu_kernel_decode_matches_the_reference(dtype: torch.dtype, window: int | None,
                                                 softcap: float | None) -> None:
    """Through the face's CpuAttention; a 1100-token context is three 512-position spans, merged
    with the sink once (a window of 700 starts mid-span)."""
    check_decode(ops.CpuAttention(), dtype, [*LENS, 1100], window, softcap, seed=5)


@needs_cpu_kernel
def test_cpu_kernel_refuses_malformed_sinks() -> None:
    key_cache, value_cache, tables = paged([5], torch.float32, 6)
    query = torch.randn(1, HEADS, HEAD_DIM)
    args = (query, key_cache, value_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
            SCALE)
    for bad in (SINKS.double(), SINKS[:2], SINKS.to(torch.bfloat16)):
        with pytest.raises(RuntimeError, match="sinks"):
            cpu.decode_attention(*args, None, None, bad)


# ------------------------------------------------------------------------------ the CUDA kernels, emulated

EMULATED = [(torch.float32, 64, BLOCK, HEADS // KV_HEADS), (torch.bfloat16, 64, BLOCK, HEADS // KV_HEADS)]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory):
    if cuda_emulator.compiler() is None:
        pytest.skip("needs g++ to build the CPU emulation")
    names = [cuda.decode_kernel_name(*case) for case in EMULATED]
    names += [cuda.reduce_kernel_name(dt, hd) for dt, hd, _, _ in EMULATED]
    return cuda_emulator.build(names, tmp_path_factory.mktemp("cuda_emulator"))


@pytest.fixture
def kernels(emulated, monkeypatch: pytest.MonkeyPatch):
    cuda_emulator.install(monkeypatch, emulated)
    return cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window,softcap", VARIANTS, ids=VARIANT_IDS)
def test_emulated_cuda_decode_single_pass_and_split_match_the_reference(kernels, dtype: torch.dtype,
                                                                        window: int | None,
                                                                        softcap: float | None) -> None:
    """The kernels directly: one pass, and three partitions of 128 (the window leaves whole ones
    before it); a padding row (length 0) stays zeros."""
    lens = [*LENS, 0]
    live = LENS
    key_cache, value_cache, tables = paged([*LENS, 1], dtype, 7)
    query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(7)).to(dtype)
    int_tables, seq_lens = torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    formula = dense(query[:-1], key_cache, value_cache, tables[:-1], live, [1] * len(live), window, softcap, SINKS)
    expected = reference.decode_attention(query[:-1].float(), key_cache.float(), value_cache.float(),
                                          torch.tensor(tables[:-1]), torch.tensor(live), SCALE, window, softcap, SINKS)
    for num_partitions in (1, 3):
        out = kernels.decode_attention(query, key_cache, value_cache, int_tables, seq_lens, SCALE,
                                       num_partitions=num_partitions, window=window, softcap=softcap, sinks=SINKS)
        close(out[:-1], formula, dtype)
        close(out[:-1], expected, dtype)
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        without = kernels.decode_attention(query, key_cache, value_cache, int_tables, seq_lens, SCALE,
                                           num_partitions=num_partitions, window=window, softcap=softcap)
        differs(out[:-1], without[:-1])


@pytest.mark.parametrize("window", [None, WINDOW])
def test_emulated_cuda_backend_decode_matches_the_reference(kernels, window: int | None) -> None:
    """Through the face's CudaAttention, its plan and workspace (a 600-token context: the split kernel)."""
    backend = ops.CudaAttention(HEADS, KV_HEADS, HEAD_DIM, 8, 1024, torch.device("cpu"))
    check_decode(backend, torch.float32, [1, 40, 600], window, None, seed=8)


def test_cuda_decode_refuses_malformed_sinks(kernels) -> None:
    key_cache, value_cache, tables = paged([5], torch.float32, 9)
    args = (torch.randn(1, HEADS, HEAD_DIM), key_cache, value_cache, torch.tensor(tables, dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32), SCALE)
    for bad in (SINKS.double(), SINKS[:2]):
        with pytest.raises(ValueError, match="sinks"):
            kernels.decode_attention(*args, sinks=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the emulated tests above run the kernels)")
@pytest.mark.parametrize("window,softcap", VARIANTS, ids=VARIANT_IDS)
def test_cuda_decode_on_a_gpu_matches_the_reference(window: int | None, softcap: float | None) -> None:
    pytest.importorskip("cupy", reason="the CUDA kernels launch through CuPy (pip install 'inferd[cuda]')")
    device = torch.device("cuda")
    lens = [*LENS, 1100]
    key_cache, value_cache, tables = paged(lens, torch.bfloat16, 10)
    query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    expected = reference.decode_attention(query.float(), key_cache.float(), value_cache.float(), torch.tensor(tables),
                                          torch.tensor(lens), SCALE, window, softcap, SINKS)
    args = (query.to(device), key_cache.to(device), value_cache.to(device),
            torch.tensor(tables, dtype=torch.int32, device=device), torch.tensor(lens, dtype=torch.int32, device=device),
            SCALE)
    for num_partitions in (1, 4):
        out = cuda.decode_attention(*args, num_partitions=num_partitions, window=window, softcap=softcap,
                                    sinks=SINKS.to(device))
        torch.testing.assert_close(out.float().cpu(), expected, atol=1.6e-2, rtol=1.6e-2)
