"""The CUDA path's kernels: CUDA C in `csrc/`, compiled at run time by NVRTC through CuPy and
launched on torch's current stream.

Each kernel is a template; a specialization (dtype, head size, block size, GQA group, the KV
cache's format: the model's dtype, or 8 bits as kv_quant.py lays out) is compiled the first time
it is asked for and kept (CuPy also caches the binary on disk). Tensors cross from torch to the
kernels as raw device pointers, without copies; a launch neither allocates nor synchronizes, so it
can be captured in a CUDA graph (call each specialization once before capturing, so that its
compilation happens outside the capture).

The pure-torch functions in `reference.py` are the specification; `tests/kernels/test_cuda_*.py`
check every kernel against them.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import site
from pathlib import Path

import numpy as np
import torch

from inferd.kernels.kv_quant import QuantizedCache

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("reshape_and_cache.cu", "paged_attention.cu", "linear_attention.cu")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_SIZES = (64, 128, 256)
BLOCK_SIZES = (16, 32)
_CTYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
# a cache's format -> the kernels' KV template argument (common.cuh): None, the model's dtype
KV_FORMATS = {None: 0, "fp8_e4m3": 1, "fp8_e5m2": 2}

THREADS = 128  # per CTA of the decode kernels (kDecodeThreads in paged_attention.cu)
PARTITION_ALIGN = 128  # partition sizes are multiples of this (and so of every block size)
MIN_PARTITION_SIZE = 256  # the split variant never cuts a context finer than this
_WHOLE_CONTEXT = 1 << 30  # the partition size that means "one partition": the single-pass kernel


def is_available() -> bool:
    """CuPy is installed and torch sees a CUDA device."""
    return importlib.util.find_spec("cupy") is not None and torch.cuda.is_available()


def supports(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether these kernels cover a model and cache of this shape."""
    return dtype in DTYPES and head_dim in HEAD_SIZES and block_size in BLOCK_SIZES


# ------------------------------------------------------------------------------ compiling


def include_dirs() -> list[str]:
    """csrc/ and, where the nvidia-cuda-runtime wheel is installed, its CUDA headers
    (cuda_fp16.h, cuda_bf16.h), so that NVRTC compiles without a CUDA toolkit."""
    dirs = [str(CSRC)]
    for root in [*site.getsitepackages(), site.getusersitepackages()]:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
            if os.path.isfile(os.path.join(root, sub, "cuda_fp16.h")):
                dirs.append(os.path.join(root, sub))
    return dirs


def compile_options() -> tuple[str, ...]:
    return ("-std=c++17", *(f"-I{d}" for d in include_dirs()))


def source(name: str) -> str:
    return (CSRC / name).read_text()


def decode_kernel_name(dtype: torch.dtype, head_dim: int, block_size: int, group: int,
                       kv_format: str | None = None) -> str:
    return f"paged_decode<{_CTYPE[dtype]}, {head_dim}, {block_size}, {group}, {KV_FORMATS[kv_format]}>"


def reduce_kernel_name(dtype: torch.dtype, head_dim: int) -> str:
    return f"paged_decode_reduce<{_CTYPE[dtype]}, {head_dim}>"


def cache_kernel_name(dtype: torch.dtype, kv_format: str | None = None) -> str:
    if kv_format is None:
        return f"reshape_and_cache<{_CTYPE[dtype]}>"
    return f"reshape_and_cache_fp8<{_CTYPE[dtype]}, {KV_FORMATS[kv_format]}>"


def covering_specializations() -> dict[str, list[str]]:
    """Per source file, a set of specializations that takes every code path: each kernel at every
    dtype x head size x block size (what changes vector widths, lanes per row and passes per
    block), and the decode kernel at the GQA groups of common models (SmolLM2: 3, Llama 3: 4); on an
    8-bit cache (whose loads are 8 codes whatever the dtype), every head size and block size in
    bfloat16 on e4m3, and each format with each dtype once.
    CI compiles these for each target architecture; bench/kernels/kernel_resources.py reports them."""
    fp8 = [f for f in KV_FORMATS if f is not None]
    return {
        "reshape_and_cache.cu": [cache_kernel_name(dt, f) for f in (None, *fp8) for dt in DTYPES],
        "paged_attention.cu": [
            *(decode_kernel_name(dt, hd, bs, 4) for dt in DTYPES for hd in HEAD_SIZES for bs in BLOCK_SIZES),
            *(decode_kernel_name(torch.bfloat16, 64, 16, g) for g in (1, 3, 8)),
            *(decode_kernel_name(torch.bfloat16, hd, bs, 4, "fp8_e4m3") for hd in HEAD_SIZES for bs in BLOCK_SIZES),
            *(decode_kernel_name(dt, 128, 16, 4, f) for f in fp8 for dt in DTYPES if (dt, f) != (torch.bfloat16, fp8[0])),
            *(reduce_kernel_name(dt, hd) for dt in DTYPES for hd in HEAD_SIZES),
        ],
        "linear_attention.cu": [
            *(name for dt in DTYPES for name in conv_kernel_names(dt, 4)),
            *conv_kernel_names(torch.bfloat16, 2),
            *(delta_kernel_name(dt, dk, dv) for dt in DTYPES for dk, dv in ((128, 128), (64, 64))),
            delta_kernel_name(torch.bfloat16, 128, 64), delta_kernel_name(torch.bfloat16, 64, 32),
        ],
    }


@functools.cache
def _kernel(file: str, name: str, device_index: int):  # -> cupy.RawKernel
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=source(file), options=compile_options(), name_expressions=[name])
        return module.get_function(name)


# ------------------------------------------------------------------------------ launching


@functools.cache
def _external_stream(handle: int, device_index: int):  # -> cupy.cuda.ExternalStream
    import cupy

    return cupy.cuda.ExternalStream(handle, device_index)


def _launch(kernel, device: torch.device, grid: tuple[int, ...], args: tuple) -> None:
    stream = _external_stream(torch.cuda.current_stream(device).cuda_stream, device.index or 0)
    with stream:
        kernel(grid, (THREADS,), args)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


Cache = torch.Tensor | QuantizedCache  # a layer's K or V: the model's dtype, or 8 bits (kv_quant.py)


def _cache_operands(key_cache: Cache, value_cache: Cache, dtype: torch.dtype) -> tuple[str | None, tuple]:
    """(the caches' 8-bit format, None for the model's dtype; the kernels' key_cache, value_cache,
    key_exps, value_exps pointers, the last two null for a plain cache), or a ValueError that says
    why the caches do not fit the kernels."""
    quantized = isinstance(key_cache, QuantizedCache), isinstance(value_cache, QuantizedCache)
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"K and V caches differ in shape: {tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    if not any(quantized):
        if key_cache.dtype != dtype or value_cache.dtype != dtype:
            raise ValueError(f"the caches must be {dtype}, got {key_cache.dtype} and {value_cache.dtype}")
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("the caches must be contiguous")
        null = np.uint64(0)
        return None, (_ptr(key_cache), _ptr(value_cache), null, null)
    if not all(quantized) or key_cache.data.dtype != value_cache.data.dtype:
        raise ValueError("K and V must be both 8-bit caches of one format, or both plain")
    for c in (key_cache, value_cache):
        if not (c.data.is_contiguous() and c.exponents.is_contiguous()) or c.exponents.dtype != torch.int8 \
                or c.exponents.shape != c.data.shape[:3]:
            raise ValueError("an 8-bit cache's codes and its int8 exponents [num_blocks, block_size, n_kv] "
                             "must be contiguous")
    return key_cache.format, (_ptr(key_cache.data), _ptr(value_cache.data), _ptr(key_cache.exponents),
                              _ptr(value_cache.exponents))


def reshape_and_cache(
    key: torch.Tensor,  # [T, n_kv, D], heads and dims contiguous (a row may be a strided slice)
    value: torch.Tensor,  # [T, n_kv, D], likewise
    key_cache: Cache,  # [num_blocks, block_size, n_kv, D], contiguous (QuantizedCache: its codes and exponents)
    value_cache: Cache,  # likewise, of key_cache's kind
    slot_mapping: torch.Tensor,  # [T] int64; negative: skip this row
) -> None:
    """Store each token's K and V in its cache slot (spec: `reference.write_kv`; for 8-bit caches
    `kv_quant.write`, bit for bit)."""
    num_tokens, n_kv, head_dim = key.shape
    if num_tokens == 0:
        return
    for name, t in (("key", key), ("value", value)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name}: heads and dims must be contiguous, got strides {t.stride()}")
        if t.dtype != key.dtype or t.dtype not in DTYPES:
            raise ValueError(f"{name} is {t.dtype}: key and value must be one of {DTYPES}")
    if tuple(key_cache.shape[2:]) != (n_kv, head_dim):
        raise ValueError(f"the caches' rows are {tuple(key_cache.shape[2:])}, the keys' {(n_kv, head_dim)}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    kv_format, caches = _cache_operands(key_cache, value_cache, key.dtype)
    kernel = _kernel("reshape_and_cache.cu", cache_kernel_name(key.dtype, kv_format), key.device.index or 0)
    strides = (np.int64(key.stride(0)), np.int64(value.stride(0)))
    if kv_format is None:
        args = (_ptr(key), _ptr(value), *caches[:2], _ptr(slot_mapping), *strides, np.int32(n_kv * head_dim))
    else:
        args = (_ptr(key), _ptr(value), *caches, _ptr(slot_mapping), *strides, np.int32(n_kv), np.int32(head_dim))
    _launch(kernel, key.device, (num_tokens,), args)


# ------------------------------------------------------------------------------ decode


class DecodeWorkspace:
    """Scratch of the split variant, allocated once (a captured graph may not allocate): each
    partition's normalized output, max score and exp-sum, for up to `max_num_seqs` sequences of
    `num_heads` heads in `max_partitions` partitions."""

    def __init__(self, max_num_seqs: int, num_heads: int, head_dim: int, max_partitions: int,
                 device: torch.device | str) -> None:
        self.max_num_seqs = max_num_seqs
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.max_partitions = max_partitions
        rows = max_num_seqs * num_heads * max_partitions
        self.part_out = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
        self.part_max = torch.empty(rows, dtype=torch.float32, device=device)
        self.part_sum = torch.empty(rows, dtype=torch.float32, device=device)

    def fits(self, num_seqs: int, num_heads: int, head_dim: int, num_partitions: int) -> bool:
        return num_seqs * num_heads * num_partitions <= self.max_num_seqs * self.num_heads * self.max_partitions \
            and head_dim == self.head_dim


def choose_num_partitions(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many partitions to cut each context into. One (the single-pass kernel) when the
    (sequence, KV head) pairs alone give every multiprocessor two CTAs; otherwise enough
    partitions for about four CTAs per multiprocessor, none shorter than MIN_PARTITION_SIZE."""
    pairs = num_seqs * num_kv_heads
    if pairs >= 2 * num_sms:
        return 1
    by_length = max_seq_len // MIN_PARTITION_SIZE
    return max(1, min(by_length, math.ceil(4 * num_sms / max(pairs, 1))))


def partition_layout(max_seq_len: int, num_partitions: int) -> tuple[int, int]:
    """(partition size, partitions actually needed) for contexts up to `max_seq_len` cut into
    about `num_partitions` parts; the size is a multiple of PARTITION_ALIGN."""
    if num_partitions <= 1:
        return _WHOLE_CONTEXT, 1
    size = math.ceil(math.ceil(max_seq_len / num_partitions) / PARTITION_ALIGN) * PARTITION_ALIGN
    return size, max(1, math.ceil(max_seq_len / size))


def _check_decode_args(query: torch.Tensor, key_cache: Cache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       sinks: torch.Tensor | None) -> None:
    """decode_attention's arguments fit its kernels, or a ValueError says which does not (the
    caches: _cache_operands)."""
    _, num_heads, head_dim = query.shape
    _, block_size, n_kv, _ = key_cache.shape
    if num_heads % n_kv:
        raise ValueError(f"{num_heads} query heads do not share {n_kv} KV heads evenly")
    if not supports(query.dtype, head_dim, block_size) or key_cache.shape[3] != head_dim:
        raise ValueError(f"no decode kernel for {query.dtype}, head size {head_dim}, block size {block_size}")
    if not query.is_contiguous():
        raise ValueError("query must be contiguous")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or not block_tables.is_contiguous():
        raise ValueError("block_tables (contiguous) and seq_lens must be int32")
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_heads,)
                              or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be float32 [{num_heads}] and contiguous")


def decode_attention(
    query: torch.Tensor,  # [N, H, D], contiguous
    key_cache: Cache,  # [num_blocks, block_size, n_kv, D], contiguous: query's dtype, or 8 bits
    value_cache: Cache,  # [num_blocks, block_size, n_kv, D], of key_cache's kind
    block_tables: torch.Tensor,  # [N, max_blocks] int32
    seq_lens: torch.Tensor,  # [N] int32: context length incl. the new token; 0 = padding row
    scale: float,
    *,
    max_seq_len: int | None = None,  # a bound on seq_lens; None reads it (a host sync)
    num_partitions: int | None = None,  # None: choose_num_partitions; 1: the single-pass kernel
    out: torch.Tensor | None = None,  # [N, H, D]
    workspace: DecodeWorkspace | None = None,  # for the split variant; None allocates one
    window: int | None = None,  # a sliding layer's: only the last `window` positions
    softcap: float | None = None,  # scores s -> tanh(s / softcap) * softcap
    sinks: torch.Tensor | None = None,  # [H] float32, contiguous: a softmax logit per head with no value
) -> torch.Tensor:
    """One query token per sequence against its paged context (spec: `reference.decode_attention`;
    an 8-bit cache is read as `kv_quant.gather` dequantizes it, exactly, but that a value under 2**-126
    is read as 0: CuPy compiles with -ftz=true, common.cuh). Capturable in a CUDA graph
    when max_seq_len, num_partitions, out and workspace are given."""
    n, num_heads, head_dim = query.shape
    _, block_size, n_kv, _ = key_cache.shape
    _check_decode_args(query, key_cache, block_tables, seq_lens, sinks)
    kv_format, caches = _cache_operands(key_cache, value_cache, query.dtype)
    if out is None:
        out = torch.empty_like(query)
    if n == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    index = query.device.index or 0  # (a CUDA tensor always names its device)
    if num_partitions is None:
        num_partitions = choose_num_partitions(n, n_kv, max_seq_len, num_sms(index))
    partition_size, num_partitions = partition_layout(max(max_seq_len, 1), num_partitions)
    group = num_heads // n_kv
    decode = _kernel("paged_attention.cu", decode_kernel_name(query.dtype, head_dim, block_size, group, kv_format),
                     index)
    common = (_ptr(query), *caches, _ptr(block_tables), _ptr(seq_lens),
              np.int32(block_tables.shape[1]), np.float32(scale), np.int32(partition_size),
              np.int32(window or 0), np.float32(softcap or 0.0))
    null = np.uint64(0)
    sink = null if sinks is None else _ptr(sinks)  # the single pass's last step adds it, or else the reduce
    if num_partitions == 1:
        _launch(decode, query.device, (n_kv, n, 1), (_ptr(out), null, null, null, *common, sink))
        return out
    if workspace is None:
        workspace = DecodeWorkspace(n, num_heads, head_dim, num_partitions, query.device)
    elif not workspace.fits(n, num_heads, head_dim, num_partitions):
        raise ValueError("the decode workspace is too small for this batch")
    reduce = _kernel("paged_attention.cu", reduce_kernel_name(query.dtype, head_dim), index)
    parts = (_ptr(workspace.part_out), _ptr(workspace.part_max), _ptr(workspace.part_sum))
    _launch(decode, query.device, (n_kv, n, num_partitions), (_ptr(out), *parts, *common, null))
    _launch(reduce, query.device, (num_heads, n),
            (_ptr(out), *parts, _ptr(seq_lens), np.int32(num_partitions), np.int32(partition_size), sink))
    return out


# ------------------------------------------------------------------------------ linear attention

LINEAR_HEAD_SIZES = (32, 64, 128)  # value heads: one column per thread of a 128-thread CTA
MAX_STATE_PER_THREAD = 128  # DK * DV / 128 floats of the state held in each thread's registers
MAX_CONV_SIZE = 8


def linear_attention_supports(dtype: torch.dtype, key_head_dim: int, value_head_dim: int, conv_size: int) -> bool:
    """Whether linear_attention.cu covers a Gated DeltaNet layer of this shape."""
    groups = THREADS // value_head_dim if value_head_dim in LINEAR_HEAD_SIZES else 0
    return (dtype in DTYPES and groups > 0 and key_head_dim % groups == 0
            and key_head_dim * value_head_dim <= MAX_STATE_PER_THREAD * THREADS and 2 <= conv_size <= MAX_CONV_SIZE)


def conv_kernel_names(dtype: torch.dtype, conv_size: int) -> tuple[str, str]:
    """(the outputs' kernel, the states' kernel)."""
    return (f"causal_conv_rows<{_CTYPE[dtype]}, {conv_size}>", f"causal_conv_states<{_CTYPE[dtype]}, {conv_size}>")


def delta_kernel_name(dtype: torch.dtype, key_head_dim: int, value_head_dim: int) -> str:
    return f"gated_delta<{_CTYPE[dtype]}, {key_head_dim}, {value_head_dim}>"


CONV_ROWS = 8  # rows per CTA of causal_conv_rows (kConvRows)


def causal_conv(
    x: torch.Tensor,  # [T, C], rows may be strided
    weight: torch.Tensor,  # [C, K] contiguous
    conv_states: torch.Tensor,  # [S, K-1, C] contiguous, x's dtype
    cu_seqlens: torch.Tensor,  # [N + 1] int64
    slots: torch.Tensor,  # [N] int64
    fresh: torch.Tensor,  # [N] bool
    save_rows: torch.Tensor,  # [M] int64, ascending
    save_slots: torch.Tensor,  # [M] int64
) -> torch.Tensor:  # [T, C]
    """The short convolution + SiLU over a step's segments, the slots updated (spec:
    linear_attention.causal_conv). Two launches: the outputs (every row at once, reading the
    old histories), then the histories; no host sync."""
    num_rows, channels = x.shape
    conv_size = weight.shape[1]
    if x.stride(1) != 1 or not (weight.is_contiguous() and conv_states.is_contiguous()):
        raise ValueError("x needs dense rows, weight and conv_states must be contiguous")
    if not (x.dtype == weight.dtype == conv_states.dtype) or conv_states.shape[1:] != (conv_size - 1, channels):
        raise ValueError(f"conv_states must be [S, {conv_size - 1}, {channels}] of x's dtype")
    y = torch.empty(num_rows, channels, dtype=x.dtype, device=x.device)
    num_seqs = slots.shape[0]
    if num_rows == 0 or num_seqs == 0:
        return y
    index = x.device.index or 0
    rows_kernel, states_kernel = (_kernel("linear_attention.cu", name, index)
                                  for name in conv_kernel_names(x.dtype, conv_size))
    blocks = -(-channels // THREADS)
    plan = (_ptr(cu_seqlens), _ptr(slots), _ptr(fresh))
    _launch(rows_kernel, x.device, (blocks, -(-num_rows // CONV_ROWS)),
            (_ptr(x), np.int64(x.stride(0)), _ptr(weight), _ptr(conv_states), _ptr(y), *plan, np.int32(num_seqs),
             np.int32(num_rows), np.int32(channels)))
    _launch(states_kernel, x.device, (blocks, num_seqs),
            (_ptr(x), np.int64(x.stride(0)), _ptr(conv_states), *plan, _ptr(save_rows), _ptr(save_slots),
             np.int32(save_rows.shape[0]), np.int32(channels)))
    return y


def gated_delta(
    q: torch.Tensor,  # [T, Hk, dk], rows may be strided, heads dense
    k: torch.Tensor,  # [T, Hk, dk], likewise
    v: torch.Tensor,  # [T, Hv, dv], likewise
    g: torch.Tensor,  # [T, Hv] float32, dense rows
    beta: torch.Tensor,  # [T, Hv] float32, dense rows
    states: torch.Tensor,  # [S, Hv, dk, dv] float32 contiguous
    cu_seqlens: torch.Tensor,  # [N + 1] int64
    slots: torch.Tensor,  # [N] int64
    fresh: torch.Tensor,  # [N] bool
    save_rows: torch.Tensor,  # [M] int64, ascending
    save_slots: torch.Tensor,  # [M] int64
) -> torch.Tensor:  # [T, Hv, dv] in v's dtype
    """The gated delta rule over a step's segments, one CTA per (sequence, value head), the slots'
    states updated (spec: linear_attention.gated_delta); no host sync."""
    num_rows, key_heads, key_dim = q.shape
    _, value_heads, value_dim = v.shape
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name}: heads and dims must be dense, got strides {t.stride()}")
    if not (q.dtype == k.dtype == v.dtype) or k.shape != q.shape or value_heads % key_heads:
        raise ValueError("q and k [T, Hk, dk], v [T, Hv, dv] of one dtype, Hv a multiple of Hk")
    if g.dtype != torch.float32 or beta.dtype != torch.float32 or g.stride(1) != 1 or beta.stride(1) != 1:
        raise ValueError("g and beta must be float32 with dense rows")
    if (states.dtype != torch.float32 or not states.is_contiguous()
            or states.shape[1:] != (value_heads, key_dim, value_dim)):
        raise ValueError(f"states must be float32 [S, {value_heads}, {key_dim}, {value_dim}], contiguous")
    o = torch.empty(num_rows, value_heads, value_dim, dtype=v.dtype, device=v.device)
    num_seqs = slots.shape[0]
    if num_rows == 0 or num_seqs == 0:
        return o
    kernel = _kernel("linear_attention.cu", delta_kernel_name(v.dtype, key_dim, value_dim), v.device.index or 0)
    _launch(kernel, v.device, (value_heads, num_seqs),
            (_ptr(o), _ptr(states), _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), np.int64(q.stride(0)),
             np.int64(k.stride(0)), np.int64(v.stride(0)), np.int64(g.stride(0)), np.int64(beta.stride(0)),
             np.int32(key_heads), _ptr(cu_seqlens), _ptr(slots), _ptr(fresh), _ptr(save_rows), _ptr(save_slots),
             np.int32(save_rows.shape[0])))
    return o
