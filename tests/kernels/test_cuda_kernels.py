"""The CUDA kernels of inferd.kernels.cuda against their torch twins in inferd.kernels.reference.

Every test builds its inputs on the GPU, runs the kernel and the reference on the same tensors
(the reference in float32 from the upcast, already rounded inputs), and compares. Skipped with a
reason where there is no CUDA device or no CuPy; `inferd.kernels.cuda.launch` is imported only then.

The paged caches hold large garbage in every slot no sequence owns (the tail of a sequence's last
block, spare blocks), and block-table columns past a sequence's blocks hold random block ids, so a
kernel that reads past a context, or through a padded table column, gets a wrong answer.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import pytest
import torch

from inferd.kernels import kv_quant, reference


def cuda_ready() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA device and CuPy")]

DEVICE = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_SIZES = [64, 128, 256]
BLOCK_SIZES = [16, 32]
# GQA group (query heads per KV head) -> number of KV heads: MHA, odd groups, Llama-3-8B's 32/8, MQA-like
KV_HEADS_OF_GROUP = {1: 4, 3: 2, 4: 8, 8: 1}
GARBAGE = 30.0  # magnitude of the values in unowned slots: a misread dominates the softmax

# Tolerances (atol = rtol) against a float32 reference computed from the same rounded inputs:
# - float32 1e-4: both sides accumulate in float32, in different orders, and the kernel may use the
#   fast __expf; over a few thousand tokens that stays near 1e-6 relative, 1e-4 leaves margin.
# - float16 2e-3: the output is rounded to float16 (unit roundoff 4.9e-4) and the kernel may round the
#   softmax weights to float16 for the P.V product (about as much again, averaged over the context).
# - bfloat16 1.6e-2 (torch's own default for bfloat16): unit roundoff 3.9e-3, the same two roundings.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    from inferd.kernels.cuda import launch as cuda

    assert cuda.is_available()
    return cuda


def make_paged_kv(
    capacity: list[int], block_size: int, n_kv: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V for sequences of `capacity` tokens each, in shuffled blocks of a fresh pool.

    Returns key_cache, value_cache ([num_blocks, block_size, n_kv, head_dim], `dtype`) and the
    block tables ([N, max_blocks + 2] int32: the last columns, and every column past a sequence's
    blocks, hold random block ids). A capacity of 0 is a padding row whose table is all garbage.
    """
    cpu_gen = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    needed = [-(-n // block_size) for n in capacity]
    num_blocks = sum(needed) + 4  # spare blocks that no table points to on purpose
    tables = torch.randint(0, num_blocks, (len(capacity), max(needed) + 2), generator=cpu_gen)  # [N, cols]
    order = torch.randperm(num_blocks, generator=cpu_gen)  # [num_blocks]
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)  # [num_slots]
    start = 0
    for s, (n, b) in enumerate(zip(capacity, needed)):
        tables[s, :b] = order[start : start + b]
        start += b
        positions = torch.arange(n)
        owned[tables[s, positions // block_size] * block_size + positions % block_size] = True
    owned = owned.to(DEVICE)[:, None, None]  # [num_slots, 1, 1]
    shape = (num_blocks * block_size, n_kv, head_dim)
    caches = []
    for _ in range(2):
        data = torch.randn(shape, generator=gen, device=DEVICE)
        garbage = GARBAGE * torch.randn(shape, generator=gen, device=DEVICE)
        cache = torch.where(owned, data, garbage).to(dtype)  # [num_slots, n_kv, head_dim]
        caches.append(cache.view(num_blocks, block_size, n_kv, head_dim))
    return caches[0], caches[1], tables.to(device=DEVICE, dtype=torch.int32)


def random_query(n: int, n_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(n, n_heads, head_dim, generator=gen, device=DEVICE).to(dtype)  # [N, H, D]


def reference_decode(
    query: torch.Tensor,  # [N, H, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [N, max_blocks]
    seq_lens: torch.Tensor,  # [N]
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [N, H, D] float32
    """reference.decode_attention in float32 on the upcast inputs; padding rows (seq_len 0) are zeros."""
    keep = seq_lens > 0  # the reference has no padding rows: a fully masked row would be NaN
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    out[keep] = reference.decode_attention(
        query[keep].float(),
        key_cache.float(),
        value_cache.float(),
        block_tables[keep],
        seq_lens[keep],
        query.shape[-1] ** -0.5,
        window,
        softcap,
    )
    return out


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.dtype == dtype, what
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


def decode_lengths(block_size: int, partition_size: int) -> list[int]:
    """Ragged contexts around every boundary a kernel has, and a padding row (0)."""
    lengths = [
        1,
        block_size - 1,
        block_size,
        block_size + 1,
        0,
        partition_size,
        partition_size + 1,
        2 * partition_size + block_size + 3,
        3001,
    ]
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(block_size))
    return [lengths[i] for i in order.tolist()]


# ---------------------------------------------------------------------------------------------
# reshape_and_cache


@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_is_bit_exact(kernels: ModuleType, dtype: torch.dtype, head_dim: int) -> None:
    num_tokens = 257
    for block_size in BLOCK_SIZES:
        for n_kv in (1, 8):
            seed = head_dim * 1000 + block_size * 10 + n_kv
            cpu_gen = torch.Generator().manual_seed(seed)
            gen = torch.Generator(device=DEVICE).manual_seed(seed)
            n_q = 4 * n_kv
            num_blocks = 2 * num_tokens // block_size + 3
            # K and V are slices of the fused projection, as in the model: [T, q + 2 kv, D] rows
            qkv = torch.randn(num_tokens, n_q + 2 * n_kv, head_dim, generator=gen, device=DEVICE).to(dtype)
            key, value = qkv[:, n_q : n_q + n_kv], qkv[:, n_q + n_kv :]  # [T, kv, D], strided rows
            slots = torch.randperm(num_blocks * block_size, generator=cpu_gen)[:num_tokens]  # distinct
            skipped = torch.rand(num_tokens, generator=cpu_gen) < 0.2
            slots[skipped] = -torch.randint(1, 5, (int(skipped.sum()),), generator=cpu_gen)  # -1 .. -4
            slots = slots.to(DEVICE)  # [T] int64
            shape = (num_blocks, block_size, n_kv, head_dim)
            key_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
            value_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
            expected_k, expected_v = key_cache.clone(), value_cache.clone()
            valid = slots >= 0
            reference.write_kv(key[valid], value[valid], expected_k, expected_v, slots[valid])

            kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
            torch.cuda.synchronize()
            what = f"block_size={block_size} n_kv={n_kv}"
            torch.testing.assert_close(key_cache, expected_k, atol=0, rtol=0, msg=lambda m: f"K {what}: {m}")
            torch.testing.assert_close(value_cache, expected_v, atol=0, rtol=0, msg=lambda m: f"V {what}: {m}")


# ---------------------------------------------------------------------------------------------
# decode


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(kernels: ModuleType, dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    lengths = decode_lengths(block_size, 2 * kernels.MIN_PARTITION_SIZE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)  # [N]
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for group, n_kv in KV_HEADS_OF_GROUP.items():
        seed = head_dim * 1000 + block_size * 10 + group
        key_cache, value_cache, tables = make_paged_kv(lengths, block_size, n_kv, head_dim, dtype, seed)
        query = random_query(len(lengths), group * n_kv, head_dim, dtype, seed)
        expected = reference_decode(query, key_cache, value_cache, tables, seq_lens)
        chosen = kernels.choose_num_partitions(len(lengths), n_kv, max(lengths), num_sms)
        assert isinstance(chosen, int) and chosen >= 1
        # None: the kernel chooses (and allocates its scratch); `chosen` passed explicitly, the same
        for num_partitions in (1, 2, 5, chosen, None):
            out = kernels.decode_attention(
                query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5, num_partitions=num_partitions
            )
            what = f"group={group} n_kv={n_kv} num_partitions={num_partitions}"
            assert out.shape == query.shape, what
            assert_matches(out, expected, dtype, what)
            padding = seq_lens == 0
            assert torch.equal(out[padding], torch.zeros_like(out[padding])), f"{what}: padding row not zero"


@pytest.mark.parametrize("window, softcap", [(7, None), (600, 30.0), (None, 5.0)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_windowed_and_capped_decode_matches_reference(kernels: ModuleType, dtype: torch.dtype, window: int | None,
                                                      softcap: float | None) -> None:
    """Sliding windows (one cutting blocks, one leaving whole partitions behind it) and soft-caps."""
    block_size, head_dim = BLOCK_SIZES[0], HEAD_SIZES[0]
    lengths = decode_lengths(block_size, 2 * kernels.MIN_PARTITION_SIZE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    for group, n_kv in KV_HEADS_OF_GROUP.items():
        seed = head_dim * 1000 + block_size * 10 + group
        key_cache, value_cache, tables = make_paged_kv(lengths, block_size, n_kv, head_dim, dtype, seed)
        query = random_query(len(lengths), group * n_kv, head_dim, dtype, seed)
        expected = reference_decode(query, key_cache, value_cache, tables, seq_lens, window, softcap)
        for num_partitions in (1, 5):
            out = kernels.decode_attention(query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5,
                                           num_partitions=num_partitions, window=window, softcap=softcap)
            assert_matches(out, expected, dtype, f"group={group} window={window} num_partitions={num_partitions}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_agrees_with_single_pass_and_uses_the_workspace(kernels: ModuleType, dtype: torch.dtype) -> None:
    n_kv, n_heads, head_dim, block_size = 8, 32, 128, 16  # Llama-3-8B
    lengths = [3001, 1, 0, 1024, 517, 4096]
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    key_cache, value_cache, tables = make_paged_kv(lengths, block_size, n_kv, head_dim, dtype, seed=7)
    query = random_query(len(lengths), n_heads, head_dim, dtype, seed=7)
    expected = reference_decode(query, key_cache, value_cache, tables, seq_lens)
    scale = head_dim**-0.5
    single = kernels.decode_attention(query, key_cache, value_cache, tables, seq_lens, scale, num_partitions=1)
    assert_matches(single, expected, dtype, "single-pass")
    # a workspace sized for a bigger batch and more partitions than this call uses, as the engine's
    workspace = kernels.DecodeWorkspace(
        max_num_seqs=16, num_heads=n_heads, head_dim=head_dim, max_partitions=8, device=DEVICE
    )
    out = torch.empty_like(query)
    args = (query, key_cache, value_cache, tables, seq_lens, scale)
    for num_partitions in (2, 5, 8):
        # max_seq_len given: no host read of seq_lens (whose .max() would allocate)
        kwargs = dict(max_seq_len=max(lengths), out=out, num_partitions=num_partitions, workspace=workspace)
        kernels.decode_attention(*args, **kwargs)  # warm-up
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = kernels.decode_attention(*args, **kwargs)
        torch.cuda.synchronize()
        what = f"split num_partitions={num_partitions}"
        assert result.data_ptr() == out.data_ptr(), f"{what}: did not write into `out`"
        assert torch.cuda.max_memory_allocated() == allocated, f"{what}: allocated with a workspace given"
        assert_matches(out, expected, dtype, what)
        # split and single-pass compute the same thing: as close to each other as each is to the reference
        assert_matches(out, single.float(), dtype, f"{what} vs single-pass")


def test_decode_launches_on_the_current_stream(kernels: ModuleType) -> None:
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is gone from this torch")
    dtype, n_kv, n_heads, head_dim, block_size = torch.bfloat16, 8, 32, 128, 16
    lengths = [2000, 300, 4096, 1]
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    key_cache, value_cache, tables = make_paged_kv(lengths, block_size, n_kv, head_dim, dtype, seed=11)
    old_query = random_query(len(lengths), n_heads, head_dim, dtype, seed=11)
    new_query = random_query(len(lengths), n_heads, head_dim, dtype, seed=12)
    expected = reference_decode(new_query, key_cache, value_cache, tables, seq_lens)
    workspace = kernels.DecodeWorkspace(len(lengths), n_heads, head_dim, max_partitions=3, device=DEVICE)
    query, out = old_query.clone(), torch.empty_like(old_query)
    args = (query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5)
    # NOTE: max_seq_len given, so decode_attention does not read seq_lens on the host: that sync
    # would wait out the sleep below and hide a launch on the wrong stream.
    kwargs = dict(max_seq_len=max(lengths), out=out, workspace=workspace)
    for num_partitions in (1, 3):  # warm-up: compile outside the timed window below
        kernels.decode_attention(*args, num_partitions=num_partitions, **kwargs)
    side = torch.cuda.Stream()
    for num_partitions in (1, 3):
        query.copy_(old_query)
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            # NOTE: the sleep (~25 ms) keeps `side` busy, so a launch on any other stream would run
            # before the new query lands and read the old one (torch's side streams don't sync with
            # the legacy default stream).
            torch.cuda._sleep(50_000_000)
            query.copy_(new_query)
            kernels.decode_attention(*args, num_partitions=num_partitions, **kwargs)
        side.synchronize()
        result = out.clone()  # read before anything else may touch `out`
        torch.cuda.synchronize()
        assert_matches(result, expected, dtype, f"on a side stream, num_partitions={num_partitions}")


@pytest.mark.parametrize("num_partitions", [1, 4])
def test_decode_replays_in_a_cuda_graph(kernels: ModuleType, num_partitions: int) -> None:
    dtype, n_kv, n_heads, head_dim, block_size = torch.bfloat16, 8, 32, 128, 16
    capacity = [4096, 1000, 2500, 64, 700]  # the block tables cover these; seq_lens change below
    key_cache, value_cache, tables = make_paged_kv(capacity, block_size, n_kv, head_dim, dtype, seed=21)
    seq_lens = torch.tensor([100, 1000, 7, 64, 0], dtype=torch.int32, device=DEVICE)  # [N], static buffer
    query = random_query(len(capacity), n_heads, head_dim, dtype, seed=21)  # [N, H, D], static buffer
    out = torch.empty_like(query)
    workspace = kernels.DecodeWorkspace(len(capacity), n_heads, head_dim, num_partitions, device=DEVICE)
    args = (query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5)
    # everything a launch needs from the host is fixed: the bound on contexts (the partition
    # size derives from it), the partition count, the output and the scratch
    kwargs = dict(max_seq_len=max(capacity), num_partitions=num_partitions, out=out, workspace=workspace)
    # warm-up on a side stream, as torch.cuda.graph asks: compiles and loads the kernel
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernels.decode_attention(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.decode_attention(*args, **kwargs)
    # longer and shorter contexts than at capture, a padding row that becomes real and one that stops
    for step, lengths in enumerate(([4096, 1, 2500, 0, 513], [33, 999, 1, 64, 0])):
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        query.copy_(random_query(len(capacity), n_heads, head_dim, dtype, seed=22 + step))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = reference_decode(query, key_cache, value_cache, tables, seq_lens)
        assert_matches(out, expected, dtype, f"replay {step}, num_partitions={num_partitions}")
    del graph


def test_choose_num_partitions(kernels: ModuleType) -> None:
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    # a batch whose (sequence, KV head) pairs fill the GPU needs no split; a 1-token context can't be
    assert kernels.choose_num_partitions(64, 8, 512, num_sms) == 1
    assert kernels.choose_num_partitions(1, 8, 1, num_sms) == 1
    # one sequence, 8 KV heads, 16k tokens: a single pass would keep a few SMs of a hundred busy
    assert kernels.choose_num_partitions(1, 8, 16384, num_sms) > 1


# ---------------------------------------------------------------------------------------------
# 8-bit caches (kv_quant.py): writes bit for bit as kv_quant.write on the CPU; decode vs the reference

TOP_CODE = {"fp8_e4m3": 0x7E, "fp8_e5m2": 0x7B}  # each format's largest finite code


@pytest.mark.parametrize("fmt", TOP_CODE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_8bit_reshape_and_cache_equals_kv_quant_write(kernels: ModuleType, dtype: torch.dtype, fmt: str) -> None:
    """K/V rows at magnitudes 2**-40 .. 2**40 (float16: 2**-14 .. 2**8), zero rows, subnormal floats, and
    rows of every code and every tie between neighbours after the format's largest value (exponent 0)."""
    num_tokens, block_size, fp8 = 257, 16, kv_quant.FORMATS[fmt][0]
    values, f16 = torch.arange(TOP_CODE[fmt] + 1, dtype=torch.uint8).view(fp8).float(), dtype == torch.float16
    for head_dim, n_kv in ((hd, n) for hd in HEAD_SIZES for n in (1, 8)):
        gen = torch.Generator().manual_seed(head_dim * 10 + n_kv)
        rows = torch.randn(2 * num_tokens * n_kv, head_dim, generator=gen)  # K and V: [T * 2 kv, D]
        rows *= torch.exp2(torch.randint(-14 if f16 else -40, 9 if f16 else 41, (len(rows), 1), generator=gen).float())
        rows[3::11] = 0.0
        rows[5::13] = torch.randn(rows[5::13].shape, generator=gen) * 2.0 ** (-14 if f16 else -135)
        ties = torch.cat((values, (values[1:] + values[:-1]) / 2, values.new_zeros(head_dim)))  # + padding
        ties = torch.cat((values[-1:].expand(len(ties) // (head_dim - 1), 1),  # the largest value first
                          ties[: len(ties) // (head_dim - 1) * (head_dim - 1)].view(-1, head_dim - 1)), 1)
        rows[1 : 1 + 2 * len(ties) : 2] = ties * torch.where(torch.rand(ties.shape, generator=gen) < 0.5, -1.0, 1.0)
        qkv = torch.cat((torch.randn(num_tokens, 4 * n_kv, head_dim, generator=gen),
                         rows.view(num_tokens, 2 * n_kv, head_dim)), 1).to(dtype)  # [T, 6 kv, D]: K, V strided
        shape = (2 * num_tokens // block_size + 3, block_size, n_kv, head_dim)
        slots = torch.randperm(shape[0] * block_size, generator=gen)[:num_tokens]
        slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1
        expected = [kv_quant.QuantizedCache(torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(fp8),
                                            torch.randint(-127, 128, shape[:3], generator=gen, dtype=torch.int8))
                    for _ in range(2)]  # random bytes: a skipped slot keeps them
        caches = [kv_quant.QuantizedCache(c.data.to(DEVICE), c.exponents.to(DEVICE)) for c in expected]
        kv_quant.write(*qkv[slots >= 0, 4 * n_kv :].split(n_kv, 1), *expected, slots[slots >= 0])
        kernels.reshape_and_cache(*qkv.to(DEVICE)[:, 4 * n_kv :].split(n_kv, 1), *caches, slots.to(DEVICE))
        for got, want, what in zip(caches, expected, (f"{kv} head_dim={head_dim} n_kv={n_kv}" for kv in "KV")):
            assert torch.equal(got.exponents.cpu(), want.exponents), f"{what}: exponents"
            assert torch.equal(got.data.cpu().view(torch.uint8), want.data.view(torch.uint8)), f"{what}: codes"


def make_paged_kv_8bit(capacity: list[int], block_size: int, n_kv: int, head_dim: int, fmt: str, seed: int):
    """make_paged_kv's caches in 8 bits, dequantized (float32), tables. A 1-token sequence's V row holds
    distinct codes of every kind, exponent -8 .. 0 (so float16 too holds it): its output, exactly."""
    key_cache, value_cache, tables = make_paged_kv(capacity, block_size, n_kv, head_dim, torch.float32, seed)
    caches = [kv_quant.QuantizedCache(*kv_quant.quantize(c, fmt)) for c in (key_cache, value_cache)]
    gen = torch.Generator().manual_seed(seed)
    finite = torch.cat((torch.arange(TOP_CODE[fmt] + 1), torch.arange(TOP_CODE[fmt] + 1) | 0x80))
    for s in (s for s, n in enumerate(capacity) if n == 1):
        slot = divmod(int(tables[s, 0]) * block_size, block_size)
        codes = finite[torch.randperm(len(finite), generator=gen)].repeat(n_kv * head_dim // len(finite) + 1)
        caches[1].data.view(torch.uint8)[slot] = codes[: n_kv * head_dim].view(n_kv, head_dim).to(DEVICE, torch.uint8)
        caches[1].exponents[slot] = torch.randint(-8, 1, (n_kv,), generator=gen, dtype=torch.int8).to(DEVICE)
    return caches, [kv_quant.dequantize(c.data, c.exponents, torch.float32) for c in caches], tables


# (query dtype, head size, block size): every lane layout of 8-code loads, each dtype; GQA 1 and 4; single
# pass and split, with and without a window, a soft-cap and sinks
CASES_8BIT = [(torch.bfloat16, 64, 16), (torch.bfloat16, 128, 32), (torch.float16, 256, 16), (torch.float32, 128, 16)]


@pytest.mark.parametrize("case", CASES_8BIT, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-b{c[2]}")
@pytest.mark.parametrize("fmt", TOP_CODE)
def test_8bit_decode_matches_reference(kernels: ModuleType, fmt: str, case) -> None:
    dtype, head_dim, block_size = case
    lengths = decode_lengths(block_size, 2 * kernels.MIN_PARTITION_SIZE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    live, ones = seq_lens > 0, [s for s, n in enumerate(lengths) if n == 1]
    for group in (1, 4):
        n_kv, seed = KV_HEADS_OF_GROUP[group], head_dim * 1000 + block_size * 10 + group
        caches, plain, tables = make_paged_kv_8bit(lengths, block_size, n_kv, head_dim, fmt, seed)
        query = random_query(len(lengths), group * n_kv, head_dim, dtype, seed)
        extras = dict(window=600, softcap=5.0, sinks=torch.randn(group * n_kv, device=DEVICE) + 1.0)
        expected = [reference_decode(query, *plain, tables, seq_lens)[live], reference.decode_attention(
            query[live].float(), *plain, tables[live], seq_lens[live], head_dim**-0.5, **extras)]
        rows = plain[1].view(-1, n_kv, head_dim)[tables[ones, 0].long() * block_size]  # [len(ones), kv, D]
        for num_partitions, extra in ((n, e) for n in (1, 5, None) for e in (0, 1)):
            out = kernels.decode_attention(query, *caches, tables, seq_lens, head_dim**-0.5,
                                           num_partitions=num_partitions, **(extras if extra else {}))
            what = f"group={group} num_partitions={num_partitions}{' window, softcap, sinks' * extra}"
            assert_matches(out[live], expected[extra], dtype, what)
            if not extra:  # (one token: its output is its V row, which the dtype holds exactly)
                assert torch.equal(out[ones], rows.repeat_interleave(group, 1).to(dtype)), f"{what}: not exact"


# ---------------------------------------------------------------------------------------------
# prefill


@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_reference(kernels: ModuleType, dtype: torch.dtype, head_dim: int) -> None:
    for block_size, table_dtype in zip(BLOCK_SIZES, (torch.int32, torch.int64)):
        for group in (1, 4):
            n_kv = KV_HEADS_OF_GROUP[group]
            # (cached prefix, chunk): fresh prompts, chunks continuing a cached prefix across block
            # and partition boundaries, 1-token chunks
            shapes = [(0, 1), (0, 77), (block_size, block_size + 1), (500, 200), (1000, 1), (3, 1), (0, 300)]
            seed = head_dim * 1000 + block_size * 10 + group
            lengths = [c + q for c, q in shapes]
            key_cache, value_cache, tables = make_paged_kv(lengths, block_size, n_kv, head_dim, dtype, seed)
            tables = tables.to(table_dtype)
            query_lens = torch.tensor([q for _, q in shapes], device=DEVICE)  # [N] int64
            seq_lens = torch.tensor(lengths, device=DEVICE)  # [N] int64
            query = random_query(int(query_lens.sum()), group * n_kv, head_dim, dtype, seed)  # [T, H, D]
            scale = head_dim**-0.5
            expected = reference.prefill_attention(
                query.float(), key_cache.float(), value_cache.float(), tables, query_lens, seq_lens, scale
            )
            # the CUDA path's prefill: the reference's gather and torch's SDPA, in the model's dtype on the device
            out = reference.prefill_attention(query, key_cache, value_cache, tables.long(), query_lens, seq_lens, scale)
            assert out.shape == query.shape
            assert_matches(out, expected, dtype, f"block_size={block_size} group={group} tables {table_dtype}")
