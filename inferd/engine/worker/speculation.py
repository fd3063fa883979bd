"""Verifying a decode's drafts: the runner's side of speculative decoding.

A decode with drafts d1..dk runs k + 1 rows in one forward: its last token t0 and the drafts, each
row attending to the positions before it (the decode kernel's rows: the same arithmetic as a
decode one token at a time). Row j's logits give the token that follows t0 d1..dj; each row is
sampled exactly as a decode would be (penalties counting the drafts before it as output), then:

    rows      t0    d1    d2    d3        sampled  s0 s1 s2 s3
    accepted: d1 == s0, d2 == s1, d3 != s2 -> the request gets d1 d2 s2 (3 tokens for one step)

A draft is accepted when it is the token the row before it sampled, so every token handed out is
one that decoding one at a time would have sampled at that point: greedy output is the same
token for token, and sampled output has the same distribution (for drafts proposed without a
model this is rejection sampling with a one-hot proposal: a draft is kept with probability
p(draft)). A seeded request's generator is wound back to where the tokens kept leave it, so its
tokens are also the same as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferd.engine.sched.plan import ScheduledChunk
from inferd.engine.sched.request import Request
from inferd.model.sampler import SamplerOutput


@dataclass(slots=True)
class SamplingRow:
    request: Request
    logits_row: int  # which row of the forward's logits
    history: list[int]  # the output before this row's token: for penalties (only where it has some)
    drafts: list[int]  # its chunk's drafts (empty: a plain row)


def sampling_rows(chunks: list[ScheduledChunk]) -> list[SamplingRow]:
    """The rows sampled in a step, in the order of the forward's logits: per sampling chunk its
    request (and the forks that start from the same logits), and a row after each draft."""
    rows: list[SamplingRow] = []
    logits_row = 0
    for chunk in chunks:
        request = chunk.request
        if not chunk.samples or request.pooling is not None:
            continue
        drafts = chunk.drafts
        assert not drafts or request.constraint is None, "a constrained request verifies no drafts"
        for member in (request, *request.forks_pending):
            rows.append(SamplingRow(member, logits_row, member.output_ids, drafts))
            penalized = member.params.adjusts_logits  # (else the history is never read: no copies)
            rows += [SamplingRow(member, logits_row + j, member.output_ids + drafts[:j] if penalized else [], drafts)
                     for j in range(1, len(drafts) + 1)]
        logits_row += 1 + len(drafts)
    return rows


def accepted_rows(rows: list[SamplingRow], token_ids: list[int]) -> list[int]:
    """The rows whose tokens are handed out: a plain row; of a verification, the rows whose
    draft matched the token sampled before it, and the row after the last of them."""
    kept: list[int] = []
    i = 0
    while i < len(rows):
        drafts = rows[i].drafts
        m = 0
        while m < len(drafts) and token_ids[i + m] == drafts[m]:
            m += 1
        kept += range(i, i + m + 1)
        i += 1 + len(drafts)
    return kept


def saved_states(rows: list[SamplingRow], generators: list[torch.Generator | None]) -> dict[int, torch.Tensor]:
    """By first row: the generator state of each seeded, sampled verification, before it draws."""
    return {i: gen.get_state() for i, (row, gen) in enumerate(zip(rows, generators))
            if gen is not None and row.drafts and not row.request.params.greedy
            and (i == 0 or rows[i - 1].request is not row.request)}


def rewind(states: dict[int, torch.Tensor], rows: list[SamplingRow], kept: list[int],
           generators: list[torch.Generator | None], logits: torch.Tensor) -> None:
    """Each seeded verification's generator as if it had drawn once per token kept (the sampler
    drew once per row: model/sampler.py's exponential race, one [vocab] draw per sampled row)."""
    if not states:
        return
    kept_set = set(kept)
    for first, state in states.items():
        gen = generators[first]
        assert gen is not None
        draws = sum(1 for i in range(first, first + 1 + len(rows[first].drafts)) if i in kept_set)
        gen.set_state(state)
        scratch = torch.empty(logits.shape[1], dtype=torch.float32, device=logits.device)
        for _ in range(draws):
            scratch.exponential_(generator=gen)


def rows_by_request(seq_ids: list[int], token_ids: list[int]) -> tuple[dict[int, int], dict[int, list[int]]]:
    """From a step's rows (StepResult.seq_ids): each request's last row, the token it sampled;
    and the drafts accepted before it, by request (none: no request verified drafts)."""
    last_row = dict(zip(seq_ids, range(len(seq_ids))))
    accepted: dict[int, list[int]] = {}
    if len(last_row) < len(seq_ids):
        for row, seq_id in enumerate(seq_ids):
            if row != last_row[seq_id]:
                accepted.setdefault(seq_id, []).append(token_ids[row])
    return last_row, accepted


def select(sampled: SamplerOutput, kept: list[int]) -> SamplerOutput:
    """The rows `kept` of a sampler's output."""
    tokens = [sampled.token_ids[i] for i in kept]
    if sampled.logprobs is None:
        return SamplerOutput(tokens, None, None)
    top = sampled.top_logprobs
    return SamplerOutput(tokens, [sampled.logprobs[i] for i in kept], None if top is None else [top[i] for i in kept])
