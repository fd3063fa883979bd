"""The kernel face (inferd.kernels.ops), op by op: every backend it can bind on this machine against
the reference (inferd.kernels.reference), through the same calls the model makes.

    op                backends checked here                 and in depth in
    layer ops         cpu (when built), reference           test_cpu_layer_ops.py
    attention         cpu (when built), torch; cuda on a GPU  test_cpu_attention.py, test_cuda_kernels.py,
                                                              test_kernels_emulated.py (CUDA on the CPU)
    block products    cpu (on AVX-512 VNNI)                 test_cpu_matmul.py

Tolerances are the in-depth tests': the fused bfloat16 ops within one bfloat16 step, RoPE + KV write
and the KV write bit for bit, attention 1e-5 (float32) / 2e-2 (bfloat16).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from inferd.kernels import cpu, ops, reference
from inferd.model.layers.rope import Rope

LLAMA = ops.LayerShape(hidden_size=576, intermediate_size=1536, head_dim=64, num_heads=9, num_kv_heads=3, eps=1e-5,
                       norm_offset=False, sandwich_norms=False, activation="silu", partial_rotary=False, qk_norm=False)
GEMMA = replace(LLAMA, norm_offset=True, sandwich_norms=True, activation="gelu_tanh", eps=1e-6)
CPU = torch.device("cpu")


def _layer_ops(shape: ops.LayerShape, dtype: torch.dtype) -> ops.LayerOps:
    return ops.layer_ops(shape, dtype, CPU, ops.TorchAttention())


def _close(got: torch.Tensor, expected: torch.Tensor, backend: str) -> None:
    """The reference's ops are the spec itself (bit for bit); the CPU's fused bfloat16 ones sum in
    another order: equal but for the odd value one bfloat16 rounding away (test_cpu_layer_ops)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if backend == "reference":
        assert torch.equal(got, expected)
        return
    step = expected.float().abs().clamp(min=1e-30) * 2**-7
    assert bool(((got.float() - expected.float()).abs() <= step).all())
    assert (got != expected).float().mean().item() < 0.01


# ------------------------------------------------------------------------------ which backend is bound


def test_the_face_binds_our_cpu_kernels_for_llama_in_bfloat16_and_the_reference_elsewhere() -> None:
    assert _layer_ops(LLAMA, torch.bfloat16).backend == ("cpu" if cpu.available() else "reference")
    assert _layer_ops(LLAMA, torch.float32).backend == "reference"
    assert _layer_ops(GEMMA, torch.bfloat16).backend == "reference"  # (1 + w) norms, GELU: no kernel


def test_select_attention_on_the_cpu() -> None:
    picked = ops.select_attention(CPU, torch.bfloat16, 9, 3, 64, 16, 8, 1024)
    assert type(picked) is (ops.CpuAttention if cpu.available() else ops.TorchAttention)
    assert type(ops.select_attention(CPU, torch.float32, 9, 3, 24, 16, 8, 1024)) is ops.TorchAttention  # head size
    assert ops.select_attention(CPU, torch.bfloat16, 9, 3, 64, 16, 8, 1024, deterministic=True).kv_block \
        == reference.KV_BLOCK


# ------------------------------------------------------------------------------ a layer's small ops

LAYER_CASES = [
    pytest.param(LLAMA, torch.bfloat16, id="llama-bf16"),  # cpu where built
    pytest.param(LLAMA, torch.float32, id="llama-f32"),  # reference
    pytest.param(GEMMA, torch.bfloat16, id="gemma-bf16"),  # reference, (1 + w) and GELU-tanh
]


@pytest.mark.parametrize("shape,dtype", LAYER_CASES)
def test_norms_match_the_reference(shape: ops.LayerShape, dtype: torch.dtype) -> None:
    bound = _layer_ops(shape, dtype)
    torch.manual_seed(0)
    x = (torch.randn(37, shape.hidden_size) * 3).to(dtype)
    x[3, 7] = 200.0  # a massive activation, as real ones have
    delta = torch.randn_like(x)
    weight = torch.rand(shape.hidden_size).to(torch.float32 if shape.norm_offset else dtype)
    _close(bound.norm(x, weight), reference.rms_norm(x, weight, shape.eps, shape.norm_offset), bound.backend)
    assert torch.equal(bound.head_norm(x, weight), reference.rms_norm(x, weight, shape.eps, shape.norm_offset))
    summed = x.clone()
    expected = reference.add_rms_norm_(summed, delta, weight, shape.eps, shape.norm_offset)
    got = bound.add_norm_(x, delta, weight)
    assert torch.equal(x, summed)  # the residual add, in place, rounded to x's dtype
    _close(got, expected, bound.backend)


@pytest.mark.parametrize("shape,dtype", LAYER_CASES)
def test_the_gated_activation_matches_the_reference(shape: ops.LayerShape, dtype: torch.dtype) -> None:
    bound = _layer_ops(shape, dtype)
    torch.manual_seed(1)
    gate_up = (torch.randn(33, 2 * shape.intermediate_size) * 4).to(dtype)
    _close(bound.gated(gate_up), reference.gated(gate_up, shape.activation), bound.backend)


ROPE_CASES = [
    pytest.param(LLAMA, torch.bfloat16, id="llama-bf16"),  # cpu's fused kernel where built
    pytest.param(replace(LLAMA, qk_norm=True), torch.bfloat16, id="qk-norm-bf16"),  # the reference's, bound by cpu
    pytest.param(LLAMA, torch.float32, id="llama-f32"),  # reference
]


@pytest.mark.parametrize("shape,dtype", ROPE_CASES)
def test_rope_and_the_kv_write_match_the_reference_bit_for_bit(shape: ops.LayerShape, dtype: torch.dtype) -> None:
    bound = _layer_ops(shape, dtype)
    heads, kv_heads, dim, tokens = shape.num_heads, shape.num_kv_heads, shape.head_dim, 7
    torch.manual_seed(2)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 3).to(dtype)  # [T, (H + 2 KV) D]
    cos_table, sin_table = Rope(10000.0, dim).tables(4096, dtype)
    positions = torch.randint(0, 4096, (tokens,))
    cos, sin = cos_table[positions], sin_table[positions]  # [T, D] each
    caches = torch.randn(2, 40, 16, kv_heads, dim).to(dtype)  # key and value: [blocks, 16, KV, D] each
    slots = torch.randperm(40 * 16)[:tokens]
    expected_caches = caches.clone().unbind(0)
    expected_q = reference.rope_write_kv(qkv, cos, sin, *expected_caches, slots, heads, kv_heads)
    key_cache, value_cache = caches.unbind(0)
    q = bound.rope_write_kv(qkv, cos, sin, key_cache, value_cache, slots)
    assert torch.equal(q, expected_q)
    assert torch.equal(key_cache, expected_caches[0]) and torch.equal(value_cache, expected_caches[1])


# ------------------------------------------------------------------------------ attention


def _cpu_backends() -> list[ops.Attention]:
    return [ops.TorchAttention(), *([ops.CpuAttention()] if cpu.available() else [])]


def _paged(dtype: torch.dtype, device: torch.device, lens: list[int], kv_heads: int = 3, head_dim: int = 64,
           block_size: int = 16, num_blocks: int = 120) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    torch.manual_seed(sum(lens))
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)  # [B, bs, KV, D]
    width = -(-max(lens) // block_size)
    tables = [torch.randperm(num_blocks)[:width].tolist() for _ in lens]  # [N][width]
    return key_cache, torch.randn_like(key_cache), tables


def _check_attention(backend: ops.Attention, dtype: torch.dtype, device: torch.device, window: int | None,
                     softcap: float | None) -> None:
    lens, query_lens, heads = [1, 15, 17, 100, 513], [1, 15, 3, 1, 40], 9
    key_cache, value_cache, tables = _paged(dtype, device, lens)
    long_tables = torch.tensor(tables, device=device)  # [N, width]
    seq_lens = torch.tensor(lens, device=device)  # [N]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
    # decode: one query per sequence
    query = torch.randn(len(lens), heads, 64, dtype=dtype, device=device)  # [N, H, D]
    plan = backend.plan_decode(tables, lens, 16, device, window)
    got = backend.decode(query, key_cache, value_cache, plan, 0.125, softcap)
    expected = reference.decode_attention(query, key_cache, value_cache, long_tables, seq_lens, 0.125, window, softcap)
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    # prefill: chunks continuing cached prefixes
    query = torch.randn(sum(query_lens), heads, 64, dtype=dtype, device=device)  # [T, H, D]
    plan = backend.plan_prefill(tables, lens, query_lens, 16, device, window)
    got = backend.prefill(query, key_cache, value_cache, plan, 0.125, softcap)
    expected = reference.prefill_attention(query, key_cache, value_cache, long_tables,
                                           torch.tensor(query_lens, device=device), seq_lens, 0.125, window, softcap)
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def _check_write_kv(backend: ops.Attention, dtype: torch.dtype, device: torch.device) -> None:
    key_cache, value_cache, _ = _paged(dtype, device, [40])
    key, value = torch.randn(2, 9, 3, 64, dtype=dtype, device=device).unbind(0)  # [T, KV, D] each
    slots = torch.randperm(120 * 16, device=device)[:9]  # [T]
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.write_kv(key, value, expected_k, expected_v, slots)
    backend.write_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("backend", _cpu_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window,softcap", [(None, None), (21, 3.0)])
def test_attention_backends_on_the_cpu_match_the_reference(backend: ops.Attention, dtype: torch.dtype,
                                                           window: int | None, softcap: float | None) -> None:
    _check_attention(backend, dtype, CPU, window, softcap)
    _check_write_kv(backend, dtype, CPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (test_kernels_emulated.py runs the CUDA "
                                                          "backend's kernels on the CPU instead)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window,softcap", [(None, None), (21, 3.0)])
def test_the_cuda_attention_backend_matches_the_reference(dtype: torch.dtype, window: int | None,
                                                          softcap: float | None) -> None:
    pytest.importorskip("cupy", reason="the CUDA kernels launch through CuPy (pip install 'inferd[cuda]')")
    device = torch.device("cuda")
    backend = ops.select_attention(device, dtype, 9, 3, 64, 16, 8, 1024)
    assert backend.name == "cuda"
    _check_attention(backend, dtype, device, window, softcap)
    _check_write_kv(backend, dtype, device)


# ------------------------------------------------------------------------------ block products


@pytest.mark.skipif(not ops.block_products_available(),
                    reason="the block products need a CPU with AVX-512 VNNI (and the kernels built)")
@pytest.mark.parametrize("bits,activation_bits", [(4, 8), (8, 8), (4, 16)])
def test_block_products_match_the_reference(bits: int, activation_bits: int) -> None:
    from inferd.model.layers.linear import BlockLinear
    from inferd.model.layers.quant import quantize_int4, quantize_int8

    torch.manual_seed(bits + activation_bits)
    w = torch.randn(48, 576) * 0.05  # [N, K]
    codes = quantize_int4(w) if bits == 4 else quantize_int8(w)
    scale = codes.scale if bits == 4 else codes.scale[:, None].expand(48, 576 // 32).contiguous()  # per block
    layer = BlockLinear(codes.codes, scale, getattr(codes, "minimum", None), None, activation_bits)
    x = torch.randn(3, 576)  # [M, K]
    got = ops.block_matmul(x, layer.weight, bits, activation_bits)  # [M, N]
    expected = reference.block_matmul(x, *layer.unpack(), activation_bits)
    torch.testing.assert_close(got.double(), expected.float().double(), atol=1e-4, rtol=1e-4)
