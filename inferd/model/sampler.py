"""Batched sampling: logits [B, V] + per-row SamplingParams -> one token (and logprobs) per row.

Order, per row: penalties -> raw logprobs (log_softmax of the unprocessed logits, vLLM's default)
-> greedy rows take the argmax of the penalized logits -> temperature -> top-k -> top-p -> min-p
-> sample. Each step runs once for the whole batch with per-row parameter tensors, and is skipped
entirely when no row needs it: an all-greedy batch is one argmax, all-default sampling is one
softmax and one exponential draw.

Sampling uses the exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) i.i.d. picks i with
probability p_i. A seeded row draws its q from its own torch.Generator (made by the caller from
the seed and advanced step by step), so it samples the same tokens alone or at any position in
any batch; unseeded rows share one batched draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inferd.text.sampling_params import SamplingParams
from inferd.kernels.tensors import device_tensor, to_device


def _argmax(x: torch.Tensor) -> torch.Tensor:  # [B, V] float32 -> [B] long, ties to the lowest id
    # NOTE: torch's CPU argmax over [256, 49152] took 19 ms here, numpy's 2.3 ms (same ties rule)
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(np.argmax(x.contiguous().numpy(), axis=-1))
    return x.argmax(dim=-1)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [B]
    logprobs: list[float] | None  # [B] chosen token's raw logprob; None if no row asked
    top_logprobs: list[list[tuple[int, float]]] | None  # [B][k_row] (id, logprob), descending


def apply_penalties(
    logits: torch.Tensor,  # [B, V] float32
    presence: torch.Tensor,  # [B] float32
    frequency: torch.Tensor,  # [B] float32
    output_token_ids: Sequence[Sequence[int]],  # [B][n_row]
) -> torch.Tensor:  # [B, V]
    """OpenAI: logit[j] -= frequency * count[j] + presence * (count[j] > 0)."""
    B, V = logits.shape
    max_len = max((len(ids) for ids in output_token_ids), default=0)
    if max_len == 0:
        return logits
    # NOTE: pad with the id V, which lands in an extra column that is dropped afterwards.
    padded = torch.full((B, max_len), V, dtype=torch.long)  # [B, max_len]
    for i, ids in enumerate(output_token_ids):
        if ids:
            padded[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    padded = to_device(padded, logits.device)
    counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device)  # [B, V + 1]
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=logits.dtype))
    counts = counts[:, :V]  # [B, V]
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def apply_top_k_top_p(
    logits: torch.Tensor,  # [B, V]
    top_k: torch.Tensor | None,  # [B] long, V means off; None: no row uses it
    top_p: torch.Tensor | None,  # [B] float32, 1 means off; None: no row uses it
) -> torch.Tensor:  # [B, V], filtered-out entries -inf
    """Both filters from one descending sort of the whole batch."""
    V = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V] each
    rank = torch.arange(V, device=logits.device)[None, :]  # [1, V]
    if top_k is not None:
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)  # [B, V]
        mass_before = probs.cumsum(dim=-1) - probs  # [B, V] mass of the strictly better tokens
        # keep the smallest prefix whose mass reaches top_p (the first token always stays);
        # NOTE: rows with top_p == 1 are exempt, else float rounding of the cumsum could drop
        # their tiniest tokens and a seeded row would sample differently inside this batch.
        drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(
    logits: torch.Tensor,  # [B, V]
    min_p: torch.Tensor,  # [B] float32, 0 means off
) -> torch.Tensor:  # [B, V]
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_token_mask(
    logits: torch.Tensor,  # [B, V] float32
    mask: torch.Tensor,  # [B, W] int32, W = ceil(V / 32): bit i of word i // 32 set = token i allowed
) -> torch.Tensor:  # [B, V] float32
    """-inf for every token a row may not take next (a grammar's mask; an unconstrained row's is
    all ones), before greedy and sampled choices alike."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)  # [32]
    allowed = ((mask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[1]]  # [B, 32 W] -> [B, V]
    return logits.masked_fill(allowed == 0, float("-inf"))


class Sampler:
    """Stateless; one call samples one token for each row of a batch."""

    def __call__(
        self,
        logits: torch.Tensor,  # [B, V], any float dtype
        params: Sequence[SamplingParams],  # [B]
        output_token_ids: Sequence[Sequence[int]],  # [B][n_row] generated so far, for penalties
        generators: Sequence[torch.Generator | None],  # [B], None: unseeded row
        mask: torch.Tensor | None = None,  # [B, ceil(V / 32)] int32 bits of the allowed tokens; None: any
    ) -> SamplerOutput:
        raw = logits.float()  # [B, V]
        processed = self.process(raw, params, output_token_ids)  # [B, V]
        if mask is not None:
            processed = apply_token_mask(processed, mask)
        token_ids = self._sample(processed, params, generators)  # [B] long
        return self._output(raw, params, token_ids)

    def process(
        self,
        logits: torch.Tensor,  # [B, V] float32
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor:  # [B, V] float32
        """Penalties and logit biases: what greedy rows take the argmax of (also a test hook)."""
        if not any(p.adjusts_logits for p in params):
            return logits
        dev = logits.device
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            presence = device_tensor([p.presence_penalty for p in params], torch.float32, dev)  # [B]
            frequency = device_tensor([p.frequency_penalty for p in params], torch.float32, dev)  # [B]
            logits = apply_penalties(logits, presence, frequency, output_token_ids)
        if any(p.logit_bias for p in params):
            rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
            tokens = [t for p in params for t, _ in p.logit_bias]
            bias = [b for p in params for _, b in p.logit_bias]
            logits = logits.index_put((device_tensor(rows, torch.int64, dev), device_tensor(tokens, torch.int64, dev)),
                                      device_tensor(bias, torch.float32, dev), accumulate=True)
        return logits

    def filter(
        self,
        logits: torch.Tensor,  # [B, V] float32, penalized
        params: Sequence[SamplingParams],
    ) -> torch.Tensor:  # [B, V] float32
        """Temperature, top-k, top-p, min-p: the logits that sampling rows draw from."""
        dev, V = logits.device, logits.shape[1]
        if any(p.temperature not in (0.0, 1.0) for p in params):
            # greedy rows divide by 1: their argmax is taken from the penalized logits anyway
            temp = device_tensor([p.temperature or 1.0 for p in params], torch.float32, dev)  # [B]
            logits = logits / temp[:, None]
        need_k = any(p.top_k > 0 for p in params)
        need_p = any(p.top_p < 1 for p in params)
        if need_k or need_p:
            top_k = device_tensor([min(p.top_k, V) if p.top_k > 0 else V for p in params],
                                  torch.int64, dev) if need_k else None  # [B]
            top_p = device_tensor([p.top_p for p in params], torch.float32, dev) if need_p else None  # [B]
            logits = apply_top_k_top_p(logits, top_k, top_p)
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, device_tensor([p.min_p for p in params], torch.float32, dev))
        return logits

    def _sample(
        self,
        logits: torch.Tensor,  # [B, V] float32, penalized
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:  # [B] long
        greedy = [p.greedy for p in params]
        if all(greedy):
            return _argmax(logits)
        probs = self.filter(logits, params).softmax(dim=-1)  # [B, V]
        q = torch.empty_like(probs)  # [B, V] ~ Exp(1)
        sampled_rows = [i for i, g in enumerate(greedy) if not g]
        if any(generators[i] is None for i in sampled_rows):
            q.exponential_()
        for i in sampled_rows:
            if generators[i] is not None:
                q[i].exponential_(generator=generators[i])
        token_ids = _argmax(probs / q)  # [B]
        if any(greedy):
            mask = device_tensor(greedy, torch.bool, logits.device)  # [B] bool
            token_ids = torch.where(mask, _argmax(logits), token_ids)
        return token_ids

    def _output(
        self,
        raw: torch.Tensor,  # [B, V] float32, unprocessed
        params: Sequence[SamplingParams],
        token_ids: torch.Tensor,  # [B] long
    ) -> SamplerOutput:
        ids = token_ids.tolist()
        if all(p.logprobs is None for p in params):
            return SamplerOutput(ids, None, None)
        logprobs = raw.log_softmax(dim=-1)  # [B, V]
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()  # [B]
        k_max = max(p.logprobs or 0 for p in params)
        top: list[list[tuple[int, float]]] = [[] for _ in params]
        if k_max > 0:
            values, indices = logprobs.topk(min(k_max, raw.shape[1]), dim=-1)  # [B, k_max] each
            values_l, indices_l = values.tolist(), indices.tolist()
            for i, p in enumerate(params):
                k = p.logprobs or 0
                top[i] = list(zip(indices_l[i][:k], values_l[i][:k]))
        return SamplerOutput(ids, chosen, top)
