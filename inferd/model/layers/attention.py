"""Attention backends: how a decoder layer writes its new K/V into the paged cache and attends
over it. The runner asks the model's backend for per-step plans; every layer then runs the
backend with them.

- `TorchAttention`: the pure-torch reference (`inferd.kernels.reference`); the CPU path, and the
  fallback for shapes the CUDA kernels do not cover.
- `CpuAttention`: our CPU kernel (`inferd.kernels.cpu`) for decode: no gather of the context,
  each row on its own in a fixed order (batch-invariant); prefill chunks as the reference.
- `CudaAttention`: our CUDA kernels (`inferd.kernels.cuda`) for the cache writes and decode;
  prefill chunks gather their context and call torch's fused SDPA, as the reference does.
"""

from __future__ import annotations

import logging

import torch

from inferd.kernels import cpu, reference
from inferd.model.tensors import device_tensor

log = logging.getLogger(__name__)


class TorchAttention:
    name = "torch"
    row_prefill = False  # decode plans may hold prefill rows too, one per token (CpuAttention)

    def __init__(self, kv_block: int | None = None) -> None:
        # contexts padded to a multiple of this: batch-invariant rows ([model] deterministic)
        self.kv_block = kv_block

    def plan_prefill(self, block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                     block_size: int, device: torch.device, window: int | None = None) -> reference.AttentionPlan:
        return reference.plan_attention(
            device_tensor(block_tables, torch.int64, device),  # [N, max_blocks]
            device_tensor(seq_lens, torch.int64, device),  # [N]
            device_tensor(query_lens, torch.int64, device),  # [N]
            block_size,
            max_seq_len=max(seq_lens), max_query_len=max(query_lens), num_query_tokens=sum(query_lens),
            kv_block=self.kv_block, window=window,
        )

    def plan_decode(self, block_tables: list[list[int]], seq_lens: list[int], block_size: int,
                    device: torch.device, window: int | None = None) -> object:
        return self.plan_prefill(block_tables, seq_lens, [1] * len(seq_lens), block_size, device, window)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        reference.write_kv(key, value, key_cache, value_cache, slot_mapping)

    def prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: object,
                scale: float, softcap: float | None = None) -> torch.Tensor:
        return reference.attention_planned(query, key_cache, value_cache, plan, scale, softcap)  # type: ignore[arg-type]

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: object,
               scale: float, softcap: float | None = None) -> torch.Tensor:
        return reference.attention_planned(query, key_cache, value_cache, plan, scale, softcap)  # type: ignore[arg-type]


class CpuAttention(TorchAttention):
    name = "cpu"
    row_prefill = True

    def plan_decode(self, block_tables: list[list[int]], seq_lens: list[int], block_size: int,
                    device: torch.device, window: int | None = None) -> object:
        return device_tensor(block_tables, torch.int32, device), device_tensor(seq_lens, torch.int32, device), window

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: object,
               scale: float, softcap: float | None = None) -> torch.Tensor:
        block_tables, seq_lens, window = plan  # type: ignore[misc]
        return cpu.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, window, softcap)


class CudaAttention(TorchAttention):
    """Decode and cache writes through our kernels. The decode plan carries host-known bounds
    (max context, partition count) so that no layer reads anything back from the device."""

    name = "cuda"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_num_seqs: int, max_model_len: int,
                 device: torch.device) -> None:
        from inferd.kernels import cuda

        super().__init__()
        self._cuda = cuda
        self.num_kv_heads = num_kv_heads
        self.num_sms = cuda.num_sms(device.index or 0)
        # the split variant's scratch, sized for the worst case once, shared by all layers
        # (they run one after another on one stream)
        max_partitions = max(cuda.partition_layout(max_model_len, cuda.choose_num_partitions(
            n, num_kv_heads, max_model_len, self.num_sms))[1] for n in range(1, max_num_seqs + 1))
        self.workspace = cuda.DecodeWorkspace(max_num_seqs, num_heads, head_dim, max_partitions, device)

    def plan_decode(self, block_tables: list[list[int]], seq_lens: list[int], block_size: int,
                    device: torch.device, window: int | None = None) -> object:
        return self.decode_plan(device_tensor(block_tables, torch.int32, device),
                                device_tensor(seq_lens, torch.int32, device), max(seq_lens), window)

    def decode_plan(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                    window: int | None = None) -> object:
        """A plan over device tensors (a captured graph's static buffers, say)."""
        num_partitions = self._cuda.choose_num_partitions(seq_lens.shape[0], self.num_kv_heads, max_seq_len,
                                                          self.num_sms)
        return self._cuda.DecodePlan(block_tables, seq_lens, max_seq_len, num_partitions, self.workspace, window)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self._cuda.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: object,
               scale: float, softcap: float | None = None) -> torch.Tensor:
        return self._cuda.decode_attention(
            query.contiguous(), key_cache, value_cache, plan.block_tables, plan.seq_lens, scale,  # type: ignore[attr-defined]
            max_seq_len=plan.max_seq_len, num_partitions=plan.num_partitions,  # type: ignore[attr-defined]
            workspace=plan.workspace, window=plan.window, softcap=softcap)  # type: ignore[attr-defined]


def select_attention(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int, max_num_seqs: int, max_model_len: int,
                     deterministic: bool = False) -> TorchAttention:
    """Our kernels where the device (CuPy on CUDA, a compiler on the CPU) and the shapes allow;
    otherwise the reference. `deterministic`: prefill contexts padded to whole blocks (the CPU's
    batch-invariant mode; decode on our CPU kernel is invariant as it is)."""
    if device.type != "cuda":
        kv_block = reference.KV_BLOCK if deterministic else None
        if cpu.supports(head_dim, num_heads, num_kv_heads) and cpu.available():
            return CpuAttention(kv_block)
        return TorchAttention(kv_block)
    if deterministic:
        log.warning("[model] deterministic is a CPU mode: on CUDA, results may still vary with the batch")
    from inferd.kernels import cuda

    if not cuda.is_available():
        log.warning("CuPy is not installed (pip install 'inferd[cuda]'): attention runs on the torch reference")
        return TorchAttention()
    if not cuda.supports(dtype, head_dim, block_size):
        log.warning("no CUDA kernel for %s, head size %d, block size %d (kernels cover head sizes %s, block sizes "
                    "%s): attention runs on the torch reference", dtype, head_dim, block_size, cuda.HEAD_SIZES,
                    cuda.BLOCK_SIZES)
        return TorchAttention()
    return CudaAttention(num_heads, num_kv_heads, head_dim, max_num_seqs, max_model_len, device)

