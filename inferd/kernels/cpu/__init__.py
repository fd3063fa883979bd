"""Our CPU kernels, batch-invariant by construction: paged decode attention over a cache in the
model's dtype or in 8 bits (csrc/cpu_attention.cpp), paged prefill attention for chunks of bfloat16
query rows on AVX512-BF16 (csrc/cpu_prefill_attention.cpp), products over block-quantized weights
on AVX-512 VNNI (csrc/cpu_matmul.cpp; inferd.model.layers.quant packs the weights for them) and,
the same bits, on AMX tiles (csrc/cpu_matmul_tiles.cpp), and a decoder layer's small bfloat16 ops
fused (csrc/cpu_layer_ops.cpp: RMSNorm, residual add + RMSNorm, SiLU x up, RoPE + the KV cache
write), registered as torch ops in csrc/bindings.cpp. inferd.kernels.reference is each one's spec;
inferd.kernels.ops, the face, is their only caller outside tests and benches.

build.py compiles them for this machine; without g++ the face binds the torch reference and
torch's packed products instead, with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from inferd.kernels.cpu import tiles as tiles  # (the room's face: ops binds its measured choice)
from inferd.kernels.cpu.build import KernelBuildError, build, library_path

log = logging.getLogger(__name__)

HEAD_SIZE_MULTIPLE = 16  # the kernel's dot product runs 16 lanes
_loaded: bool | None = None  # None: not tried yet


def available() -> bool:
    """Load the kernel, building it first if this machine has none; False (and a warning) if not."""
    global _loaded
    if _loaded is None:
        try:
            path = library_path()
            if not path.exists():
                log.info("building the CPU kernels for this machine (once; make does it ahead)")
            torch.ops.load_library(str(build()))
            _loaded = True
        except (KernelBuildError, OSError, RuntimeError) as e:
            log.warning("CPU kernels unavailable, using the torch reference and torch's products: %s", e)
            _loaded = False
    return _loaded


def kernels() -> Any:
    """The registered ops themselves (csrc/bindings.cpp: torch.ops.inferd_cpu), for the face to bind
    with no Python frame between a layer and a kernel. Call after available() is True."""
    return torch.ops.inferd_cpu


MAX_HEAD_DIM = 512  # cpu_attention.cpp's kMaxDim: a row of scores and its sum live on the stack
MAX_PREFILL_GROUP = 96  # cpu_prefill_attention.cpp's kLanes: a task's query heads per KV head, at least


def supports(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    return head_dim % HEAD_SIZE_MULTIPLE == 0 and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0


def block_matmul_available() -> bool:
    """The quantized products run here: the kernels built, and on a CPU with AVX-512 VNNI."""
    return available() and torch.ops.inferd_cpu.block_matmul_available()


def block_matmul(x: torch.Tensor,  # [M, K]
                 weight: torch.Tensor,  # uint8 [N / 16, K / 32, bytes]: linear.BlockLinear's packing
                 bits: int,  # the weights' codes: 4 or 8
                 activation_bits: int = 8) -> torch.Tensor:  # [M, N], x's dtype; 16 for 4-bit weights only
    return torch.ops.inferd_cpu.block_matmul(x, weight, bits, activation_bits)


def block_matmul_tiles(x: torch.Tensor, weight: torch.Tensor, bits: int, activation_bits: int = 8,
                       emulate: bool = False) -> torch.Tensor:
    """block_matmul on AMX tiles: the same bits. `emulate`: the tiles' arithmetic in plain C++ (tests, any CPU)."""
    return torch.ops.inferd_cpu.block_matmul_tiles(x, weight, bits, activation_bits, emulate)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [T, H] bfloat16
    return torch.ops.inferd_cpu.rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (rounded to bfloat16); returns RMSNorm(x) * weight."""
    return torch.ops.inferd_cpu.add_rms_norm_(x, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I] bfloat16
    return torch.ops.inferd_cpu.silu_mul(gate_up)


def rope_write_kv(qkv: torch.Tensor,  # [T, (H + 2 KV) x D] bfloat16
                  cos: torch.Tensor, signed_sin: torch.Tensor,  # [T, D] bfloat16 each
                  key_cache: torch.Tensor, value_cache: torch.Tensor,  # [blocks, block_size, KV, D] bfloat16
                  slot_mapping: torch.Tensor,  # [T] int64, negative: padding
                  num_heads: int, num_kv_heads: int) -> torch.Tensor:  # q: [T, H, D]
    """q and k rotated (inferd.kernels.reference.rotate's arithmetic), k and v written to their slots
    (inferd.kernels.reference.write_kv's), in one pass."""
    return torch.ops.inferd_cpu.rope_write_kv(qkv, cos, signed_sin, key_cache, value_cache, slot_mapping,
                                              num_heads, num_kv_heads)


def decode_attention(query: torch.Tensor,  # [N, heads, head_dim]
                     key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
                     value_cache: torch.Tensor,
                     block_tables: torch.Tensor,  # [N, width] int32
                     seq_lens: torch.Tensor,  # [N] int32
                     scale: float,
                     window: int | None = None,  # a sliding layer's: only the last `window` positions
                     softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:  # [heads] float32 -> [N, heads, head_dim]
    return torch.ops.inferd_cpu.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                                 window or 0, softcap or 0.0, sinks)


def decode_attention_8bit(query: torch.Tensor,  # [N, heads, head_dim] bfloat16 or float32
                          key_codes: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] float8
                          key_exponents: torch.Tensor,  # [num_blocks, block_size, kv_heads] int8
                          value_codes: torch.Tensor,
                          value_exponents: torch.Tensor,
                          block_tables: torch.Tensor,  # [N, width] int32
                          seq_lens: torch.Tensor,  # [N] int32
                          scale: float,
                          window: int | None = None,
                          softcap: float | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:  # -> [N, heads, head_dim]
    """decode_attention over an 8-bit cache (inferd.kernels.kv_quant's layout: each row
    float(code) * 2**exponent, e4m3fn or e5m2 codes)."""
    return torch.ops.inferd_cpu.decode_attention_8bit(query, key_codes, key_exponents, value_codes, value_exponents,
                                                      block_tables, seq_lens, scale, window or 0, softcap or 0.0,
                                                      sinks)


def prefill_attention_available() -> bool:
    """The prefill kernel runs here: the kernels built, on a CPU with AVX512-BF16."""
    return available() and torch.ops.inferd_cpu.prefill_attention_available()


def prefill_attention(query: torch.Tensor,  # [T, heads, head_dim] bfloat16: each sequence's chunk, in order
                      key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] bfloat16
                      value_cache: torch.Tensor,
                      block_tables: torch.Tensor,  # [N, width] int32
                      seq_lens: torch.Tensor,  # [N] int32: context lengths, the chunk included (its last rows)
                      query_starts: torch.Tensor,  # [N + 1] int32: sequence i's rows [starts[i], starts[i + 1])
                      scale: float,
                      window: int | None = None,
                      softcap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:  # [heads] float32 -> [T, heads, head_dim]
    """Each chunk row attends causally to its context, read from the cache in place (the chunk's own
    K/V written already); batch-invariant: a row's bits do not depend on its chunk or batch."""
    return torch.ops.inferd_cpu.prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, query_starts,
                                                  scale, window or 0, softcap or 0.0, sinks)


def prefill_attention_8bit(query: torch.Tensor,  # [T, heads, head_dim] bfloat16
                           key_codes: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] float8
                           key_exponents: torch.Tensor,  # [num_blocks, block_size, kv_heads] int8
                           value_codes: torch.Tensor,
                           value_exponents: torch.Tensor,
                           block_tables: torch.Tensor,
                           seq_lens: torch.Tensor,
                           query_starts: torch.Tensor,
                           scale: float,
                           window: int | None = None,
                           softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """prefill_attention over an 8-bit cache (kv_quant's layout), its rows read exactly."""
    return torch.ops.inferd_cpu.prefill_attention_8bit(query, key_codes, key_exponents, value_codes, value_exponents,
                                                       block_tables, seq_lens, query_starts, scale, window or 0,
                                                       softcap or 0.0, sinks)
