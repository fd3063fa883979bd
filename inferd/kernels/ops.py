"""The kernel face: the one module the model reaches its ops through, and the only one outside the
device rooms (cpu/, cuda/) that imports them.

    model/ ──> ops ──┬──> cpu/        our C++ kernels (torch ops inferd_cpu::*)
                     ├──> cuda/       our CUDA kernels (NVRTC through CuPy)
                     └──> reference   the torch spec of every op, bound where no kernel covers a shape

Each op is chosen once, when the model is loaded (or its attention backend is set), for its
device, dtype and shapes; a call then goes straight to the bound function, with no device test
on the hot path. The ops:
- a decoder layer's small ops (`LayerOps`): RMSNorm, residual add + RMSNorm, the gated
  activation, RoPE + the KV cache write;
- attention over the paged cache (`Attention` backends), each over its own kind of `AttentionPlan`,
  its K/V in the model's dtype or in 8 bits (kv_quant.QuantizedCache, the backend's `kv_format`);
- products over block-quantized weights (`block_matmul`);
- linear attention's short convolution and gated delta rule (`LinearAttentionOps`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inferd.kernels import cpu, linear_attention, reference
from inferd.kernels.cuda import launch as cuda
from inferd.kernels.kv_quant import QuantizedCache
from inferd.kernels.reference import Cache
from inferd.kernels.tensors import device_tensor

log = logging.getLogger(__name__)

Tensor = torch.Tensor


# ------------------------------------------------------------------------------ attention plans

GatherPlan = reference.AttentionPlan  # the reference's: gather indices and masks (prefill, and decode on torch)


@dataclass
class RowPlan:
    """Decode row by row over the paged cache, as our CPU and CUDA kernels do it."""

    block_tables: Tensor  # [N, width] int32
    seq_lens: Tensor  # [N] int32: context lengths, the new token included
    window: int | None = None  # the sliding layers' plan
    # CUDA's split decode: a bound on seq_lens known on the host, the partitions and their scratch
    max_seq_len: int = 0
    num_partitions: int = 1
    workspace: cuda.DecodeWorkspace | None = None


@dataclass
class ChunkPlan:
    """Prefill chunks over the paged cache, as our CPU prefill kernel reads them: each sequence's
    query rows in order, its context up to each row read from its blocks in place."""

    block_tables: Tensor  # [N, width] int32
    seq_lens: Tensor  # [N] int32: context lengths, the chunk included
    query_starts: Tensor  # [N + 1] int32: sequence i's rows are [starts[i], starts[i + 1])
    window: int | None = None


AttentionPlan = GatherPlan | RowPlan | ChunkPlan  # one step's plan for a group of rows, shared by the layers


# ------------------------------------------------------------------------------ attention backends


class TorchAttention:
    """The reference (`reference.attention_planned`): the CPU path where our kernel does not fit,
    and the fallback for shapes the CUDA kernels do not cover."""

    name = "torch"
    row_prefill = False  # decode plans may hold prefill rows too, one per token (CpuAttention)

    def __init__(self, kv_block: int | None = None, kv_format: str | None = None) -> None:
        # contexts padded to a multiple of this: batch-invariant rows ([model] deterministic)
        self.kv_block = kv_block
        # the cache's 8-bit format (kv_quant.FORMATS), None: the model's dtype; every backend reads
        # either, this tells layer_ops which KV write to bind
        self.kv_format = kv_format

    def plan_prefill(self, block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                     block_size: int, device: torch.device, window: int | None = None,
                     bidirectional: bool = False) -> AttentionPlan:
        """`bidirectional`: each query sees its whole context, past and future (an encoder's prompt,
        which the runner computes in one chunk from position 0)."""
        return reference.plan_attention(
            device_tensor(block_tables, torch.int64, device),  # [N, max_blocks]
            device_tensor(seq_lens, torch.int64, device),  # [N]
            device_tensor(query_lens, torch.int64, device),  # [N]
            block_size,
            max_seq_len=max(seq_lens), max_query_len=max(query_lens), num_query_tokens=sum(query_lens),
            kv_block=self.kv_block, window=window, bidirectional=bidirectional,
        )

    def plan_decode(self, block_tables: list[list[int]], seq_lens: list[int], block_size: int,
                    device: torch.device, window: int | None = None) -> AttentionPlan:
        return self.plan_prefill(block_tables, seq_lens, [1] * len(seq_lens), block_size, device, window)

    def write_kv(self, key: Tensor, value: Tensor, key_cache: Cache, value_cache: Cache,
                 slot_mapping: Tensor) -> None:
        reference.write_kv(key, value, key_cache, value_cache, slot_mapping)

    def prefill(self, query: Tensor, key_cache: Cache, value_cache: Cache, plan: AttentionPlan,
                scale: float, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
        """sinks: [num_heads] float32 on the cache's device, a softmax logit per head with no value (gpt-oss)."""
        assert isinstance(plan, GatherPlan)
        return reference.attention_planned(query, key_cache, value_cache, plan, scale, softcap, sinks)

    def decode(self, query: Tensor, key_cache: Cache, value_cache: Cache, plan: AttentionPlan,
               scale: float, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
        assert isinstance(plan, GatherPlan)
        return reference.attention_planned(query, key_cache, value_cache, plan, scale, softcap, sinks)


class CpuAttention(TorchAttention):
    """Our CPU kernels: decode row by row, and (bfloat16 on AVX512-BF16: `chunk_prefill`) prefill
    chunks, both over the paged cache in place, each row's sums in an order fixed by the row alone
    (batch-invariant); elsewhere prefill chunks go as the reference, and so do an encoder's
    bidirectional prompts."""

    name = "cpu"
    row_prefill = True

    def __init__(self, kv_block: int | None = None, kv_format: str | None = None, chunk_prefill: bool = False) -> None:
        super().__init__(kv_block, kv_format)
        self.chunk_prefill = chunk_prefill

    def plan_prefill(self, block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                     block_size: int, device: torch.device, window: int | None = None,
                     bidirectional: bool = False) -> AttentionPlan:
        if bidirectional or not self.chunk_prefill:
            return super().plan_prefill(block_tables, seq_lens, query_lens, block_size, device, window, bidirectional)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return ChunkPlan(device_tensor(block_tables, torch.int32, device), device_tensor(seq_lens, torch.int32, device),
                         device_tensor(starts, torch.int32, device), window)

    def prefill(self, query: Tensor, key_cache: Cache, value_cache: Cache, plan: AttentionPlan,
                scale: float, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
        if not isinstance(plan, ChunkPlan):
            return super().prefill(query, key_cache, value_cache, plan, scale, softcap, sinks)
        if isinstance(key_cache, QuantizedCache):
            assert isinstance(value_cache, QuantizedCache)
            return cpu.prefill_attention_8bit(query, key_cache.data, key_cache.exponents, value_cache.data,
                                              value_cache.exponents, plan.block_tables, plan.seq_lens,
                                              plan.query_starts, scale, plan.window, softcap, sinks)
        return cpu.prefill_attention(query, key_cache, value_cache, plan.block_tables, plan.seq_lens, plan.query_starts,
                                     scale, plan.window, softcap, sinks)

    def plan_decode(self, block_tables: list[list[int]], seq_lens: list[int], block_size: int,
                    device: torch.device, window: int | None = None) -> AttentionPlan:
        return RowPlan(device_tensor(block_tables, torch.int32, device), device_tensor(seq_lens, torch.int32, device),
                       window)

    def decode(self, query: Tensor, key_cache: Cache, value_cache: Cache, plan: AttentionPlan,
               scale: float, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
        assert isinstance(plan, RowPlan)
        if isinstance(key_cache, QuantizedCache):
            assert isinstance(value_cache, QuantizedCache)
            return cpu.decode_attention_8bit(query, key_cache.data, key_cache.exponents, value_cache.data,
                                             value_cache.exponents, plan.block_tables, plan.seq_lens, scale,
                                             plan.window, softcap, sinks)
        return cpu.decode_attention(query, key_cache, value_cache, plan.block_tables, plan.seq_lens, scale,
                                    plan.window, softcap, sinks)


class CudaAttention(TorchAttention):
    """Decode and cache writes on our CUDA kernels; prefill chunks gather their context and call
    torch's fused SDPA, as the reference does. The decode plan carries host-known bounds (max
    context, partition count) so that no layer reads anything back from the device."""

    name = "cuda"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_num_seqs: int, max_model_len: int,
                 device: torch.device, kv_format: str | None = None) -> None:
        super().__init__(kv_format=kv_format)
        self.num_kv_heads = num_kv_heads
        self.num_sms = cuda.num_sms(device.index or 0)
        # the split variant's scratch, sized for the worst case once, shared by all layers
        # (they run one after another on one stream)
        max_partitions = max(cuda.partition_layout(max_model_len, cuda.choose_num_partitions(
            n, num_kv_heads, max_model_len, self.num_sms))[1] for n in range(1, max_num_seqs + 1))
        self.workspace = cuda.DecodeWorkspace(max_num_seqs, num_heads, head_dim, max_partitions, device)

    def plan_decode(self, block_tables: list[list[int]], seq_lens: list[int], block_size: int,
                    device: torch.device, window: int | None = None) -> AttentionPlan:
        return self.decode_plan(device_tensor(block_tables, torch.int32, device),
                                device_tensor(seq_lens, torch.int32, device), max(seq_lens), window)

    def decode_plan(self, block_tables: Tensor, seq_lens: Tensor, max_seq_len: int,
                    window: int | None = None) -> RowPlan:
        """A plan over device tensors (a captured graph's static buffers, say)."""
        num_partitions = cuda.choose_num_partitions(seq_lens.shape[0], self.num_kv_heads, max_seq_len, self.num_sms)
        return RowPlan(block_tables, seq_lens, window, max_seq_len, num_partitions, self.workspace)

    def write_kv(self, key: Tensor, value: Tensor, key_cache: Cache, value_cache: Cache,
                 slot_mapping: Tensor) -> None:
        cuda.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)  # type: ignore[arg-type]

    def decode(self, query: Tensor, key_cache: Cache, value_cache: Cache, plan: AttentionPlan,
               scale: float, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
        assert isinstance(plan, RowPlan)
        # (an 8-bit cache's QuantizedCache goes as it is: launch.py reads both layouts)
        return cuda.decode_attention(
            query.contiguous(), key_cache, value_cache,  # type: ignore[arg-type]
            plan.block_tables, plan.seq_lens, scale,
            max_seq_len=plan.max_seq_len, num_partitions=plan.num_partitions, workspace=plan.workspace,
            window=plan.window, softcap=softcap, sinks=sinks)


Attention = TorchAttention  # the backends' common face: CpuAttention and CudaAttention refine it


def select_attention(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int, max_num_seqs: int, max_model_len: int,
                     deterministic: bool = False, kv_format: str | None = None) -> TorchAttention:
    """Our kernels where the device (CuPy on CUDA, a compiler on the CPU) and the shapes allow;
    otherwise the reference. `deterministic`: the reference's prefill contexts padded to whole
    blocks (the CPU's batch-invariant mode; our CPU kernels are invariant as they are). `kv_format`: the
    cache's 8-bit format (kv_quant.FORMATS), None for the model's dtype."""
    if device.type != "cuda":
        kv_block = reference.KV_BLOCK if deterministic else None
        if cpu.supports(head_dim, num_heads, num_kv_heads) and cpu.available():
            chunks = (dtype == torch.bfloat16 and num_heads // num_kv_heads <= cpu.MAX_PREFILL_GROUP
                      and cpu.prefill_attention_available())
            return CpuAttention(kv_block, kv_format, chunks)
        return TorchAttention(kv_block, kv_format)
    if deterministic:
        log.warning("[model] deterministic is a CPU mode: on CUDA, results may still vary with the batch")
    if not cuda.is_available():
        log.warning("CuPy is not installed (pip install 'inferd[cuda]'): attention runs on the torch reference")
        return TorchAttention(kv_format=kv_format)
    if not cuda.supports(dtype, head_dim, block_size):
        log.warning("no CUDA kernel for %s, head size %d, block size %d (kernels cover head sizes %s, block sizes "
                    "%s): attention runs on the torch reference", dtype, head_dim, block_size, cuda.HEAD_SIZES,
                    cuda.BLOCK_SIZES)
        return TorchAttention(kv_format=kv_format)
    return CudaAttention(num_heads, num_kv_heads, head_dim, max_num_seqs, max_model_len, device, kv_format)


# ------------------------------------------------------------------------------ a layer's small ops


@dataclass(frozen=True)
class LayerShape:
    """What decides which backend runs a decoder's small ops (from the model's config)."""

    hidden_size: int
    intermediate_size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    eps: float
    norm_offset: bool  # Gemma's x̂·(1 + w)
    sandwich_norms: bool
    activation: str  # "silu" | "gelu_tanh"
    partial_rotary: bool  # RoPE over part of each head
    qk_norm: bool


@dataclass(frozen=True)
class LayerOps:
    """A decoder's small ops, each bound to one backend for the model's dtype, device and shapes."""

    backend: str  # "cpu" (our fused kernels) or "reference"
    norm: Callable[[Tensor, Tensor], Tensor]  # (x [T, hidden], weight) -> normed: the layers' and the final norm
    add_norm_: Callable[[Tensor, Tensor, Tensor], Tensor]  # (x, delta, weight): x += delta; norm(x)
    gated: Callable[[Tensor], Tensor]  # [T, 2I] -> [T, I]: activation(gate) x up
    # (qkv [T, (H + 2 KV) D], cos, signed_sin, key_cache, value_cache, slot_mapping) -> q [T, H, D]
    rope_write_kv: Callable[[Tensor, Tensor, Tensor, Cache, Cache, Tensor], Tensor]
    head_norm: Callable[[Tensor, Tensor], Tensor]  # q/k heads' and sandwich norms: always the reference's


def layer_ops(shape: LayerShape, dtype: torch.dtype, device: torch.device, attention: TorchAttention) -> LayerOps:
    """Bind each small op once: our CPU kernels for Llama-shaped layers in bfloat16 on the CPU (the
    default serving path: the same roundings, fewer passes), the reference elsewhere, whose KV
    write is the attention backend's (CUDA's kernel on a GPU). An 8-bit cache (the backend's
    `kv_format`) is written by the backend's write_kv: the fused RoPE + write stores bfloat16."""
    eps, offset, heads, kv_heads = shape.eps, shape.norm_offset, shape.num_heads, shape.num_kv_heads

    def head_norm(x: Tensor, weight: Tensor) -> Tensor:
        return reference.rms_norm(x, weight, eps, offset)

    fused = (dtype == torch.bfloat16 and device.type == "cpu" and not offset and not shape.sandwich_norms
             and shape.activation == "silu" and shape.hidden_size % 16 == 0 and shape.intermediate_size % 16 == 0
             and cpu.available())
    if fused:
        kernels = cpu.kernels()
        rope_fused = (not shape.partial_rotary and shape.head_dim % 32 == 0 and not shape.qk_norm
                      and attention.kv_format is None)
        return LayerOps(
            "cpu",
            norm=lambda x, weight: kernels.rms_norm(x, weight, eps),
            add_norm_=lambda x, delta, weight: kernels.add_rms_norm_(x, delta, weight, eps),
            gated=kernels.silu_mul,
            rope_write_kv=(
                (lambda qkv, cos, sin, kc, vc, slots: kernels.rope_write_kv(qkv, cos, sin, kc, vc, slots, heads,
                                                                            kv_heads))
                if rope_fused else _rope_then_write(attention, heads, kv_heads)),
            head_norm=head_norm,
        )
    activation = shape.activation
    return LayerOps(
        "reference",
        norm=head_norm,
        add_norm_=lambda x, delta, weight: reference.add_rms_norm_(x, delta, weight, eps, offset),
        gated=lambda gate_up: reference.gated(gate_up, activation),
        rope_write_kv=_rope_then_write(attention, heads, kv_heads),
        head_norm=head_norm,
    )


def _rope_then_write(attention: TorchAttention, heads: int,
                     kv_heads: int) -> Callable[[Tensor, Tensor, Tensor, Cache, Cache, Tensor], Tensor]:
    """reference.rope_write_kv, its KV write the attention backend's (CUDA's kernel on a GPU)."""
    write = attention.write_kv
    return lambda qkv, cos, sin, kc, vc, slots: reference.rope_write_kv(qkv, cos, sin, kc, vc, slots, heads, kv_heads,
                                                                        write)


# ------------------------------------------------------------------------------ block products


def block_products_available() -> bool:
    """Products over block-quantized weights run here: our CPU kernels built, on AVX-512 VNNI."""
    return cpu.block_matmul_available()


# (M rows of x's dtype, uint8 weights as linear.BlockLinear packs them, bits 4 | 8, activation bits 8 | 16)
# -> [M, N] in x's dtype: the CPU room's kernels, on VNNI or (the same bits) on AMX tiles
block_matmul = cpu.block_matmul
block_matmul_tiles = cpu.block_matmul_tiles
# where AMX is usable, the measured choice between the two (cpu/tiles.py): (weight, bits,
# activation bits) -> the row count from which the tiles run, or None; and -> whether a prompt's
# rows run faster on the tiles than on a dense bf16 copy
tile_rows = cpu.tiles.tile_rows
tiles_beat_dense = cpu.tiles.tiles_beat_dense


# ------------------------------------------------------------------------------ linear attention

# (x [T, C], weight [C, K], conv_states [S, K-1, C], plan) -> y [T, C]: linear_attention.causal_conv
ConvOp = Callable[[Tensor, Tensor, Tensor, linear_attention.StatePlan], Tensor]
# (q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv] float32, states [S, Hv, dk, dv] float32, plan)
# -> o [T, Hv, dv]: linear_attention.gated_delta
DeltaOp = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, linear_attention.StatePlan], Tensor]


@dataclass(frozen=True)
class LinearAttentionOps:
    """A Gated DeltaNet layer's two ops, bound to one backend (their spec: linear_attention.py)."""

    backend: str  # "cpu" | "cuda" | "reference"
    conv: ConvOp
    delta: DeltaOp


def linear_attention_ops(device: torch.device, dtype: torch.dtype, *, key_head_dim: int = 128,
                         value_head_dim: int = 128, conv_size: int = 4) -> LinearAttentionOps:
    """On the CPU, our decode-step kernels for the one-token rows (the hot path) and the
    reference's chunked torch for prefill segments (matmuls over 64-token chunks, which torch
    already runs well); on CUDA, our kernels over every segment; the reference elsewhere, and for
    shapes no kernel covers (the head sizes and conv width default to Qwen3.5's)."""
    if device.type == "cpu" and cpu.available():
        if key_head_dim % 16 == 0 and max(key_head_dim, value_head_dim) <= 256 and 2 <= conv_size <= 8:
            kernels = cpu.kernels()
            return LinearAttentionOps(
                "cpu",
                conv=lambda x, weight, conv_states, plan: linear_attention.causal_conv(
                    x, weight, conv_states, plan, kernels.conv_step),
                delta=lambda q, k, v, g, beta, states, plan: linear_attention.gated_delta(
                    q, k, v, g, beta, states, plan, kernels.delta_step),
            )
        log.warning("no CPU linear-attention kernel for head sizes %d/%d, conv width %d: decode runs on the torch "
                    "reference", key_head_dim, value_head_dim, conv_size)
    if device.type == "cuda":
        if cuda.is_available() and cuda.linear_attention_supports(dtype, key_head_dim, value_head_dim, conv_size):
            return cuda_linear_attention()
        log.warning("no CUDA linear-attention kernel here (CuPy missing, or %s with head sizes %d/%d, conv width "
                    "%d): it runs on the torch reference", dtype, key_head_dim, value_head_dim, conv_size)
    return reference_linear_attention()


def cuda_linear_attention() -> LinearAttentionOps:
    """Our CUDA kernels over every segment (cuda.linear_attention_supports says for which shapes)."""
    return LinearAttentionOps(
        "cuda",
        conv=lambda x, weight, conv_states, plan: cuda.causal_conv(
            x, weight, conv_states, plan.cu_seqlens, plan.slots, plan.fresh, plan.save_rows, plan.save_slots),
        delta=lambda q, k, v, g, beta, states, plan: cuda.gated_delta(
            q, k, v, g, beta, states, plan.cu_seqlens, plan.slots, plan.fresh, plan.save_rows, plan.save_slots),
    )


def reference_linear_attention() -> LinearAttentionOps:
    return LinearAttentionOps("reference", conv=linear_attention.causal_conv, delta=linear_attention.gated_delta)
