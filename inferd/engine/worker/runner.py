"""Turns a scheduler's plan (ids and counts) into tensors, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inferd.engine.protocol import TokenLogprob
from inferd.engine.worker.cuda_graphs import DecodeGraphs
from inferd.engine.worker.kv_cache import KVCache
from inferd.engine.worker.speculation import accepted_rows, rewind, sampling_rows, saved_states, select
from inferd.engine.structured.masks import MaskFiller
from inferd.engine.sched.request import Request
from inferd.engine.sched.plan import ScheduledChunk, SchedulerOutput
from inferd.model.decoder import DecoderModel, LayerAttention, StepAttention
from inferd.model.layers.linear import DENSE_PREFILL_MIN_TOKENS
from inferd.model.pooling import Pooler
from inferd.model.sampler import Sampler, SamplerOutput
from inferd.kernels.linear_attention import StatePlan
from inferd.kernels.tensors import device_tensor


@dataclass
class StepResult:
    # the sequences (choices) that sampled a token, in row order; one that verified drafts has a
    # row for each draft accepted, then one for the token it sampled after them
    seq_ids: list[int]
    sampled: SamplerOutput
    # choices whose own logits constraint raised: their row sampled unconstrained, to be failed
    failed: dict[int, Exception] = field(default_factory=dict)
    # (params.prompt_logprobs) seq_id -> (first prompt position, the logprobs of the tokens after
    # it and its successors in this step's chunk)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # pooling requests whose prompt this step finished: seq_id -> the pooled hidden state [hidden]
    # float32 (task "embed", before the pooler's projection) or the score (task "score")
    pooled: dict[int, torch.Tensor | float] = field(default_factory=dict)

    @classmethod
    def concat(cls, parts: list[StepResult]) -> StepResult:
        """One result from the results of a step run in pieces (rows in the pieces' order)."""
        if len(parts) == 1:
            return parts[0]
        seq_ids = [s for p in parts for s in p.seq_ids]
        token_ids = [t for p in parts for t in p.sampled.token_ids]
        failed = {k: v for p in parts for k, v in p.failed.items()}
        prompt = {k: v for p in parts for k, v in p.prompt_logprobs.items()}
        pooled = {k: v for p in parts for k, v in p.pooled.items()}
        if all(p.sampled.logprobs is None for p in parts):
            return cls(seq_ids, SamplerOutput(token_ids, None, None), failed, prompt, pooled)
        # a piece whose rows asked for no logprobs has none: its rows never read them
        logprobs = [x for p in parts for x in (p.sampled.logprobs or [0.0] * len(p.seq_ids))]
        top = [x for p in parts for x in (p.sampled.top_logprobs or [[] for _ in p.seq_ids])]
        return cls(seq_ids, SamplerOutput(token_ids, logprobs, top), failed, prompt, pooled)


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: KVCache, sampler: Sampler | None = None,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler or Sampler()
        self.device = model.device
        self.graphs = graphs  # CUDA graphs for decode-only steps, if captured
        self._generators: dict[int, torch.Generator] = {}  # per seeded request, advanced every step
        self.masks = MaskFiller(model.cfg.vocab_size)
        # per layer, its KV group (whose block tables and attention plans it uses) and slot
        self._placement = kv_cache.layout.placement()
        # (mean and cls pooling) seq_id -> (prompt positions pooled so far, their sum or first row)
        self._pools: dict[int, tuple[int, torch.Tensor]] = {}
        self.pooler: Pooler | None = None  # the model's (the engine sets it): how pooling requests pool

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.apply_block_ops(out)
        return self.run(out.prefills, out.decodes)

    def apply_block_ops(self, out: SchedulerOutput) -> None:
        """The step's block moves, before any forward that reads them."""
        # this order: a block swap-out frees (or the prefix cache evicts: offloads) may be reused by
        # a swap-in, an onload or a copy-on-write
        self.kv_cache.swap_out(out.swap_out)
        self.kv_cache.offload(out.offloads)
        self.kv_cache.swap_in(out.swap_in)
        self.kv_cache.onload(out.onloads)
        self.kv_cache.copy_blocks(out.block_copies)
        self.kv_cache.apply_state_ops(out.state_ops)

    def run(self, prefills: list[ScheduledChunk], decodes: list[ScheduledChunk]) -> StepResult:
        """Forward these chunks and sample a token for each that ends its prompt or decodes (and
        verify a decode's drafts: speculation.py)."""
        prefills = sorted(prefills, key=lambda c: not _dense_prefill(c))  # (dense rows first: StepAttention)
        chunks = prefills + decodes
        # one row per sampling request, plus one per fork (n > 1) that starts from the same logits,
        # plus one per draft (its logits sample the token after it, as if the draft were output)
        rows = sampling_rows(chunks)
        requests = [r.request for r in rows]
        prompt_rows = _prompt_rows(prefills)
        extra = [i for _, _, indices in prompt_rows for i in indices]
        # the grammar masks are computed while the model runs; never left running past this call
        pending = self.masks.start([r.constraint for r in requests])
        pools = _pool_rows(prefills)
        try:
            logits, hidden = self._forward(prefills, decodes, extra, [i for _, _, indices in pools for i in indices])
        finally:
            masks, failed_rows = pending.result() if pending is not None else (None, {})
        pooled = self._pool(pools, hidden) if pools else {}
        prompt_logprobs = {}
        if extra:  # (their rows come after the sampled ones)
            prompt_logprobs = _prompt_logprobs(prompt_rows, logits[-len(extra):])
            logits = logits[: -len(extra)]
        logit_rows = [r.logits_row for r in rows]
        if len(logit_rows) != logits.shape[0]:
            logits = logits[logit_rows]
        if not rows:  # (pooling requests alone)
            return StepResult([], SamplerOutput([], None, None), {}, prompt_logprobs, pooled)
        generators = [self._generator(r) for r in requests]
        states = saved_states(rows, generators)
        sampled = self.sampler(
            logits,
            [r.params for r in requests],
            [r.history for r in rows],
            generators,
            None if masks is None else torch.from_numpy(masks).to(self.device, non_blocking=True),
        )
        failed = {requests[i].seq_id: e for i, e in failed_rows.items()}
        if not any(c.drafts for c in decodes):
            return StepResult([r.seq_id for r in requests], sampled, failed, prompt_logprobs, pooled)
        kept = accepted_rows(rows, sampled.token_ids)
        rewind(states, rows, kept, generators, logits)
        return StepResult([requests[i].seq_id for i in kept], select(sampled, kept), failed, prompt_logprobs, pooled)

    def _forward(self, prefills: list[ScheduledChunk], decodes: list[ScheduledChunk],
                 extra_rows: list[int] | None = None,
                 hidden_rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits of every sampled row, then of `extra_rows` (flat token indices); and the
        final hidden states [len(hidden_rows), hidden] float32 of `hidden_rows` (None: none asked)."""
        if self.graphs is not None and not prefills and self.graphs.covers(decodes):
            return self.graphs.run(decodes), None
        input_ids, positions, attn, logits_indices = self._prepare(prefills, decodes)
        if extra_rows:
            logits_indices = torch.cat([logits_indices, device_tensor(extra_rows, torch.int64, self.device)])
        model = self.model
        if not hidden_rows:
            return model.forward(input_ids, positions, self.kv_cache.layers, attn, logits_indices), None
        x = model.trunk(input_ids, positions, self.kv_cache.layers, attn)
        logits = model.logits(x, logits_indices) if logits_indices.numel() else x.new_empty(0, 0)
        return logits, model.hidden(x, device_tensor(hidden_rows, torch.int64, self.device))

    def _pool(self, pools: list[tuple[ScheduledChunk, int, list[int]]],
              hidden: torch.Tensor | None) -> dict[int, torch.Tensor | float]:
        """Each pooling chunk's hidden rows folded into its request's pool; the requests whose
        prompt ends here, with their pooled state (or score)."""
        assert hidden is not None
        done: dict[int, torch.Tensor | float] = {}
        row = 0
        scores: list[tuple[int, int, tuple[int, int]]] = []
        for chunk, first, indices in pools:
            request, rows = chunk.request, hidden[row: row + len(indices)]
            row += len(indices)
            pooling, seq_id = request.pooling, request.seq_id
            assert pooling is not None
            if pooling.task == "score":
                assert pooling.score_tokens is not None
                scores.append((seq_id, row - 1, pooling.score_tokens))
            elif self.pooler is None or self.pooler.method == "last":
                if chunk.samples:
                    done[seq_id] = rows[-1]
            else:  # mean, cls: what the earlier chunks pooled, and this one's positions not yet pooled
                counted, pool = self._pools.get(seq_id, (0, rows.new_zeros(rows.shape[1])))
                new = rows[max(0, counted - first):]
                if self.pooler.method == "mean":
                    pool = pool + new.sum(0)
                elif counted == 0 and len(new):
                    pool = new[0]
                counted = max(counted, first + len(indices))
                self._pools[seq_id] = (counted, pool)
                if chunk.samples:
                    done[seq_id] = pool / counted if self.pooler.method == "mean" else pool
                    del self._pools[seq_id]
        if scores:  # the head's rows at each score's last position: logit[yes] - logit[no]
            logits = self.model.lm_head(hidden[[r for _, r, _ in scores]].to(self.model.dtype)).float()
            for i, (seq_id, _, (no, yes)) in enumerate(scores):
                done[seq_id] = float(logits[i, yes] - logits[i, no])
        return done

    def release(self, seq_id: int) -> None:
        """Forget a finished request's sampling and pooling state."""
        self._generators.pop(seq_id, None)
        self._pools.pop(seq_id, None)

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.params.seed
        if seed is None:
            return None
        gen = self._generators.get(request.seq_id)
        if gen is None:
            # choice i of a seeded n > 1 request draws from seed + i, so choices differ
            gen = torch.Generator(device=self.device).manual_seed(seed + request.index)
            self._generators[request.seq_id] = gen
        return gen

    def _prepare(
        self, prefills: list[ScheduledChunk], decodes: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, StepAttention, torch.Tensor]:
        # NOTE: built in plain Python, then one torch.tensor per buffer: every torch op releases
        # the GIL, and while the event loop thread is busy streaming, each re-acquisition can
        # wait a whole switch interval (5 ms), so a few dozen small ops cost more than the lists.
        chunks = prefills + decodes
        device = self.device
        ids: list[int] = []  # [T]
        positions: list[int] = []  # [T]
        logits_indices: list[int] = []  # [S]
        seq_lens: list[int] = []  # [N]
        query_lens: list[int] = []  # [N]
        for c in chunks:
            start, n = c.start, c.num_tokens
            end = start + n
            if c.drafts:  # a decode verifying drafts: its last token, then the drafts
                ids += c.request.token_ids(start, start + 1) + c.drafts
            else:
                ids += c.request.token_ids(start, end)
            if n == 1:
                positions.append(start)
            else:
                positions += range(start, end)
            if c.samples and c.request.pooling is None:
                logits_indices += range(len(ids) - 1 - len(c.drafts), len(ids))
            seq_lens.append(end)
            query_lens.append(n)
        dense = sum(1 for c in prefills if _dense_prefill(c))  # (first: run sorted them)
        # short prompts attend row by row through the decode kernel where the backend can (the
        # CPU's): one row per token, its context up to itself, no padding of the context
        # (bidirectional attention: every prompt row sees the whole prompt, so never row by row)
        p = dense if self.model.attention.row_prefill and not self.model.cfg.bidirectional else len(prefills)
        groups = [self._group_attention(chunks, g, window, seq_lens, query_lens, p)
                  for g, window in enumerate(self.kv_cache.layout.windows)]
        attn = StepAttention(
            layers=[groups[g] for g, _slot in self._placement],
            num_prefill_tokens=sum(query_lens[:p]),
            dense_rows=sum(query_lens[:dense]),
            state=_state_plan(chunks, len(decodes), device) if self.kv_cache.states is not None else None,
        )
        return (
            device_tensor(ids, torch.int64, device),
            device_tensor(positions, torch.int64, device),
            attn,
            device_tensor(logits_indices, torch.int64, device),
        )

    def _group_attention(self, chunks: list[ScheduledChunk], group: int, window: int | None, seq_lens: list[int],
                         query_lens: list[int], p: int) -> LayerAttention:
        """One KV group's slots and attention plans: chunks [0, p) as the prefill group (block
        tables, context and query lengths), the rest as rows (one per token)."""
        backend, bs, device = self.model.attention, self.kv_cache.block_size, self.device
        slot_mapping: list[int] = []  # [T]
        # block tables cut to each chunk's context and padded with block 0 to the widest
        max_blocks = -(-max(seq_lens) // bs)
        rows: list[list[int]] = []  # [N, max_blocks]
        for c, end in zip(chunks, seq_lens):
            table, start = c.block_tables[group], c.start
            if c.num_tokens == 1:
                slot_mapping.append(table[start // bs] * bs + start % bs)
            else:
                slot_mapping += [table[q // bs] * bs + q % bs for q in range(start, end)]
            width = -(-end // bs)
            rows.append(table[:width] + [0] * (max_blocks - width))
        tables: list[list[int]] = []
        lens: list[int] = []
        for row, end, n in zip(rows[p:], seq_lens[p:], query_lens[p:]):
            tables += [row] * n
            lens += range(end - n + 1, end + 1)
        prefill = (backend.plan_prefill(rows[:p], seq_lens[:p], query_lens[:p], bs, device, window,
                                        bidirectional=self.model.cfg.bidirectional) if p else None)
        decode = backend.plan_decode(tables, lens, bs, device, window) if tables else None
        return LayerAttention(device_tensor(slot_mapping, torch.int64, device), prefill, decode)


def _state_plan(chunks: list[ScheduledChunk], num_decode: int, device: torch.device) -> StatePlan:
    """The linear layers' segments: one per chunk, in row order, each with its state slot, and
    its checkpoint saves as rows (the row of the token that ends the block)."""
    saves: list[tuple[int, int]] = []
    row = 0
    for c in chunks:
        saves += [(row + end - c.start - 1, slot) for end, slot in c.state_saves]
        row += c.num_tokens
    return StatePlan.build([c.num_tokens for c in chunks], [c.state_slot for c in chunks],
                           [c.start == 0 for c in chunks], saves, num_decode, device)


def _prompt_rows(prefills: list[ScheduledChunk]) -> list[tuple[Request, int, list[int]]]:
    """(request, first position, flat token indices) of the prefill positions whose logits score
    the next prompt token, for the requests that want their prompt's logprobs."""
    rows, offset = [], 0
    for c in prefills:
        if c.request.params.prompt_logprobs is not None:
            end = min(c.start + c.num_tokens, len(c.request.prompt_ids) - 1)
            if end > c.start:
                rows.append((c.request, c.start, list(range(offset, offset + end - c.start))))
        offset += c.num_tokens
    return rows


def _prompt_logprobs(rows: list[tuple[Request, int, list[int]]],
                     logits: torch.Tensor) -> dict[int, tuple[int, list[TokenLogprob]]]:
    """Each position's log-softmax at the prompt's next token, and its top alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    out: dict[int, tuple[int, list[TokenLogprob]]] = {}
    row = 0
    for request, first, indices in rows:
        part = logprobs[row: row + len(indices)]
        row += len(indices)
        nexts = request.prompt_ids[first + 1: first + 1 + len(indices)]
        chosen = part.gather(1, torch.tensor(nexts, device=part.device)[:, None])[:, 0].tolist()
        k = request.params.prompt_logprobs or 0
        top_values, top_ids = part.topk(k, dim=-1) if k else (part[:, :0], part[:, :0].long())
        out[request.seq_id] = (first, [
            TokenLogprob(token, lp, list(zip(ids, values)))
            for token, lp, ids, values in zip(nexts, chosen, top_ids.tolist(), top_values.tolist())])
    return out


def _pool_rows(prefills: list[ScheduledChunk]) -> list[tuple[ScheduledChunk, int, list[int]]]:
    """(chunk, first position, flat token indices) of the pooling requests' rows whose hidden
    states are wanted: every row of mean and cls pooling's chunks (cls keeps the first), the
    last prompt row of last-token pooling and of scores."""
    rows, offset = [], 0
    for c in prefills:
        request = c.request
        if request.pooling is not None:
            if request.pools_every_token:
                rows.append((c, c.start, list(range(offset, offset + c.num_tokens))))
            elif c.samples:
                rows.append((c, c.start + c.num_tokens - 1, [offset + c.num_tokens - 1]))
        offset += c.num_tokens
    return rows


def _dense_prefill(chunk: ScheduledChunk) -> bool:
    """A long prompt's chunk: its rows multiply by packed layers' dense copies (linear.SplitLinear)."""
    return len(chunk.request.prompt_ids) >= DENSE_PREFILL_MIN_TOKENS
