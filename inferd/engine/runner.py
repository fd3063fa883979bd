"""Turns a scheduler's plan (ids and counts) into tensors, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferd.engine.kv_cache import KVCache
from inferd.engine.request import Request
from inferd.engine.scheduler import ScheduledChunk, SchedulerOutput
from inferd.kernels import reference
from inferd.model.llama import LlamaModel, StepAttention
from inferd.model.sampler import Sampler, SamplerOutput


@dataclass
class StepResult:
    request_ids: list[int]  # the requests that sampled a token, in row order
    sampled: SamplerOutput


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, sampler: Sampler | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler or Sampler()
        self.device = model.device
        self._generators: dict[int, torch.Generator] = {}  # per seeded request, advanced every step

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.kv_cache.copy_blocks(out.block_copies)
        chunks = out.prefills + out.decodes
        input_ids, positions, attn, logits_indices = self._prepare(out.prefills, out.decodes)
        logits = self.model.forward(input_ids, positions, self.kv_cache.layers, attn, logits_indices)
        # one row per sampling request, plus one per fork (n > 1) that starts from the same logits
        rows: list[Request] = []
        logit_rows: list[int] = []
        for i, chunk in enumerate(c for c in chunks if c.samples):
            for request in (chunk.request, *chunk.request.forks_pending):
                rows.append(request)
                logit_rows.append(i)
        if len(logit_rows) != logits.shape[0]:
            logits = logits[logit_rows]
        sampled = self.sampler(
            logits,
            [r.params for r in rows],
            [r.output_ids for r in rows],
            [self._generator(r) for r in rows],
        )
        return StepResult([r.request_id for r in rows], sampled)

    def release(self, request_id: int) -> None:
        """Forget a finished request's sampling state."""
        self._generators.pop(request_id, None)

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.params.seed
        if seed is None:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            # choice i of a seeded n > 1 request draws from seed + i, so choices differ
            gen = torch.Generator(device=self.device).manual_seed(seed + request.index)
            self._generators[request.request_id] = gen
        return gen

    def _prepare(
        self, prefills: list[ScheduledChunk], decodes: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, StepAttention, torch.Tensor]:
        chunks = prefills + decodes
        block_size = self.kv_cache.block_size
        device = self.device
        ids: list[int] = []
        for c in chunks:
            ids += c.request.token_ids(c.start, c.start + c.num_tokens)
        starts = torch.tensor([c.start for c in chunks], dtype=torch.int64)  # [N]
        query_lens = torch.tensor([c.num_tokens for c in chunks], dtype=torch.int64)  # [N]
        seq_lens = starts + query_lens  # [N]
        max_blocks = max(-(-int(n) // block_size) for n in seq_lens.tolist())
        rows = []
        for c in chunks:
            table = c.block_table[: -(-(c.start + c.num_tokens) // block_size)]
            rows.append(table + [0] * (max_blocks - len(table)))
        tables = torch.tensor(rows, dtype=torch.int64)  # [N, max_blocks]

        # per token: its chunk, position and cache slot
        chunk_of_token = torch.repeat_interleave(torch.arange(len(chunks)), query_lens)  # [T]
        first_token = torch.cumsum(query_lens, 0) - query_lens  # [N]
        positions = starts[chunk_of_token] + torch.arange(len(ids)) - first_token[chunk_of_token]  # [T]
        slot_mapping = tables[chunk_of_token, positions // block_size] * block_size + positions % block_size
        last_tokens = first_token + query_lens - 1  # [N]
        logits_indices = last_tokens[[i for i, c in enumerate(chunks) if c.samples]]

        p = len(prefills)
        num_prefill_tokens = int(query_lens[:p].sum())
        tables, seq_lens, query_lens = tables.to(device), seq_lens.to(device), query_lens.to(device)
        attn = StepAttention(
            slot_mapping=slot_mapping.to(device),
            num_prefill_tokens=num_prefill_tokens,
            prefill=reference.plan_attention(tables[:p], seq_lens[:p], query_lens[:p], block_size) if p else None,
            decode=(
                reference.plan_attention(tables[p:], seq_lens[p:], query_lens[p:], block_size) if decodes else None
            ),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        return input_ids, positions.to(device), attn, logits_indices.to(device)
