"""Decode-only steps replayed from CUDA graphs.

A decode step of a small model is hundreds of short kernel launches; launching them from Python
costs more than running them. At start-up the whole forward of a decode step is captured once
per batch-size bucket, over static input buffers; a step then copies its ids, positions, slots,
block tables and context lengths into those buffers (one pinned host-to-device copy per buffer)
and replays the bucket's graph. Rows past the batch are padding: slot -1 (the cache write skips
it) and context length 0 (attention writes zeros), and their logits are ignored.

Steps with a prefill chunk, or more decodes than the largest bucket, run eagerly.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from inferd.engine.worker.kv_cache import KVCache
from inferd.engine.sched.plan import ScheduledChunk
from inferd.kernels.ops import CudaAttention
from inferd.model.decoder import DecoderModel, LayerAttention, StepAttention

log = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to 64, then of 16, up to max_num_seqs (included)."""
    buckets = [b for b in (1, 2, 4) if b < max_num_seqs]
    b = 8
    while b < max_num_seqs:
        buckets.append(b)
        b += 8 if b < 64 else 16
    buckets.append(max_num_seqs)
    return buckets


class DecodeGraphs:
    def __init__(self, model: DecoderModel, kv_cache: KVCache, max_num_seqs: int, max_model_len: int) -> None:
        if not isinstance(model.attention, CudaAttention):
            raise ValueError("CUDA graphs need the CUDA attention backend (their launches are capturable)")
        if len(kv_cache.layout.groups) > 1:
            raise ValueError("CUDA graphs cover models with one KV group (no sliding and full layers mixed)")
        self.model = model
        self.backend: CudaAttention = model.attention  # (narrowed by the check above)
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_num_seqs)
        self.block_size = kv_cache.block_size
        self.max_blocks = math.ceil(max_model_len / self.block_size)
        largest = self.buckets[-1]
        device = model.device
        # static inputs of every graph (a bucket of b rows uses the first b), and their pinned
        # host mirrors: [ids | positions | slots] as int64, [seq_lens | block tables] as int32
        self._longs = torch.zeros(3, largest, dtype=torch.int64, device=device)
        self._ints = torch.zeros(largest * (1 + self.max_blocks), dtype=torch.int32, device=device)
        self._host_longs = torch.zeros(3, largest, dtype=torch.int64, pin_memory=True)
        self._host_ints = torch.zeros(largest * (1 + self.max_blocks), dtype=torch.int32, pin_memory=True)
        self._rows = torch.arange(largest, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, logits)

    # ------------------------------------------------------------------------------ capture

    def capture(self) -> None:
        """Capture one graph per bucket, largest first (the smaller ones reuse its memory pool).
        Each bucket runs once eagerly first: its kernels compile and its memory is allocated
        outside the capture."""
        start = time.perf_counter()
        self._fill([], 0)  # all padding: no cache slot is written while capturing
        pool = torch.cuda.graph_pool_handle()
        # NOTE: the warm-up runs on the capture stream itself, so that CuPy's handle on that
        # stream exists before the capture (nothing may query a stream while it captures)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for b in reversed(self.buckets):
            with torch.cuda.stream(stream):
                self._forward(b)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = self._forward(b)
            self._graphs[b] = (graph, logits)
        torch.cuda.synchronize()
        log.info("captured %d decode graphs (batch sizes %s) in %.1f s", len(self.buckets), self.buckets,
                 time.perf_counter() - start)

    def _forward(self, b: int) -> torch.Tensor:  # [b, vocab] float32
        seq_lens = self._ints[:b]
        tables = self._ints[self._largest: self._largest + b * self.max_blocks].view(b, self.max_blocks)
        # (one KV group: DecodeGraphs refuses more)
        window = self.kv_cache.layout.groups[0].window
        decode = self.backend.decode_plan(tables, seq_lens, self.max_model_len, window)
        plans = LayerAttention(self._longs[2, :b], None, decode)
        attn = StepAttention(layers=[plans] * self.model.cfg.num_layers, num_prefill_tokens=0)
        return self.model.forward(self._longs[0, :b], self._longs[1, :b], self.kv_cache.layers, attn,
                                  self._rows[:b])

    @property
    def _largest(self) -> int:
        return self.buckets[-1]

    # ------------------------------------------------------------------------------ replay

    def covers(self, decodes: list[ScheduledChunk]) -> bool:
        return (bool(self._graphs) and 0 < len(decodes) <= self._largest
                and all(c.samples and not c.drafts for c in decodes))

    def run(self, decodes: list[ScheduledChunk]) -> torch.Tensor:  # [len(decodes), vocab] float32
        n = len(decodes)
        b = next(size for size in self.buckets if size >= n)
        self._fill(decodes, b)
        graph, logits = self._graphs[b]
        graph.replay()
        return logits[:n]

    def _fill(self, decodes: list[ScheduledChunk], b: int) -> None:
        """Write the step's inputs into the static buffers: rows [0, n) from `decodes`, rows
        [n, b) padding (b = 0: every row)."""
        rows = b or self._largest
        longs, ints = self._host_longs, self._host_ints
        bs, width = self.block_size, self.max_blocks
        ids, positions, slots = longs[0].numpy(), longs[1].numpy(), longs[2].numpy()
        seq_lens = ints[:rows].numpy()
        tables = ints[self._largest: self._largest + rows * width].numpy().reshape(rows, width)
        for i, chunk in enumerate(decodes):
            p = chunk.start
            ids[i] = chunk.request.token_ids(p, p + 1)[0]
            positions[i] = p
            slots[i] = chunk.block_table[p // bs] * bs + p % bs
            seq_lens[i] = p + 1
            table = chunk.block_table[: p // bs + 1]
            tables[i, : len(table)] = table
        n = len(decodes)
        ids[n:rows] = 0
        positions[n:rows] = 0
        slots[n:rows] = -1
        seq_lens[n:rows] = 0
        # NOTE: the non-blocking copies read the pinned buffers when the stream reaches them;
        # the previous step's copies are done by now, since its sampled ids were read back.
        for field in range(3):  # contiguous slices only: a strided copy would stage through pageable memory
            self._longs[field, :rows].copy_(longs[field, :rows], non_blocking=True)
        self._ints[:rows].copy_(ints[:rows], non_blocking=True)
        tables_at = slice(self._largest, self._largest + rows * width)
        self._ints[tables_at].copy_(ints[tables_at], non_blocking=True)
