"""The speculator: before each step it gives the decoding requests their drafts, after it learns
what was accepted. Pure and synchronous (no tensors), called by the engine thread alone.

    method "suffix" / "ngram"   every decoding request drafts from its own tokens (drafters.py),
                                and, where its tenant opted in (speculative_history), from that
                                tenant's recent outputs too (bounded: [speculative] history_tokens)
    method "auto"               suffix drafts, and only where they pay:
        per step     none in a step with more requests decoding than `max_batch`: a batch that
                     large is compute-bound, and verification rows cost nearly as much as decodes
        per request  a request whose drafts keep being rejected (smoothed acceptance below 25%
                     alone, below 75% beside other requests) drafts again only from a long match
                     (a copy starting); accepted drafts warm it back up
    method "off"

Drafts are capped by `max_draft_tokens` and by what the request may still write (max_tokens,
the context). A request with a logits constraint (a grammar, a reasoning budget) drafts nothing:
each draft row would need the mask of the grammar advanced through the drafts before it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from inferd.engine.protocol import SpeculationSnapshot
from inferd.engine.sched.plan import SchedulerOutput
from inferd.engine.sched.request import Request, RequestStatus
from inferd.engine.spec.drafters import NgramIndex, SuffixIndex, TenantHistory
from inferd.settings.engine import SpeculativeSettings

log = logging.getLogger(__name__)

# "auto": a request whose share of drafts accepted (smoothed) is below this is cold, and drafts
# only from a match at least COLD_MATCH long. Alone, a draft row costs little beside the step's
# weight reads; beside other requests it costs nearly a decode (bench/speculation/crossover.py)
COLD_ACCEPTANCE = {True: 0.25, False: 0.75}  # by "alone"
COLD_MATCH = 8
SMOOTHING = 0.3  # the weight of the latest verification in a request's acceptance
HISTORY_CONTEXT = 32  # a request's last tokens matched against its tenant's history


@dataclass(slots=True)
class _Drafting:
    """One request's drafting state."""

    index: SuffixIndex | NgramIndex
    fed: int = 0  # its tokens the index has seen
    acceptance: float = 1.0  # accepted / drafted, smoothed over its verifications


class Speculator:
    def __init__(self, settings: SpeculativeSettings, off_reason: str | None = None) -> None:
        self.settings = settings
        self.method = "off" if off_reason is not None else settings.method
        self.off_reason = off_reason
        if off_reason is not None and settings.method != "off":
            log.info("speculative decoding is off for this model: %s", off_reason)
        self._requests: dict[int, _Drafting] = {}
        self._histories: dict[str, TenantHistory] = {}  # per tenant that opted in
        self.drafted_tokens = self.accepted_tokens = self.verifications = 0
        self.steps_drafted = self.steps_off = 0

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def draft(self, running: list[Request]) -> None:
        """Set `draft_ids` of the running requests whose next step is a decode."""
        if not self.enabled:
            return
        decoding = []
        for r in running:
            if r.draft_ids:  # (any left from a step that did not run it)
                r.draft_ids = []
            if r.num_tokens - r.num_computed_tokens == 1 and not r.paused and r.status == RequestStatus.RUNNING:
                decoding.append(r)
        if self.method == "auto" and len(decoding) > self.settings.max_batch:
            self.steps_off += 1
            return
        cold = COLD_ACCEPTANCE[len(decoding) == 1]
        for req in decoding:
            room = min(self.settings.max_draft_tokens, req.max_total_tokens - req.num_tokens - 1)
            if room > 0 and req.constraint is None and req.pooling is None:
                req.draft_ids = self._propose(req, room, cold)

    def _propose(self, req: Request, room: int, cold: float) -> list[int]:
        state = self._requests.get(req.seq_id)
        if state is None:
            index = NgramIndex() if self.method == "ngram" else SuffixIndex()
            state = self._requests[req.seq_id] = _Drafting(index)
        if state.fed < req.num_tokens:
            state.index.extend(req.token_ids(state.fed, req.num_tokens))
            state.fed = req.num_tokens
        draft = state.index.propose(room)
        if req.draft_history and req.tenant is not None and (history := self._histories.get(req.tenant)):
            # (its tenant's earlier outputs: a longer match there wins)
            theirs = history.propose(req.token_ids(max(0, req.num_tokens - HISTORY_CONTEXT), req.num_tokens), room)
            if theirs.match_len > draft.match_len:
                draft = theirs
        if self.method == "auto" and state.acceptance < cold and draft.match_len < COLD_MATCH:
            return []
        return draft.tokens

    def after_step(self, plan: SchedulerOutput, accepted: dict[int, list[int]]) -> None:
        """Count the step's verifications, and learn each request's acceptance."""
        drafted = False
        for chunk in plan.decodes:
            if not chunk.drafts:
                continue
            drafted = True
            n = len(accepted.get(chunk.request.seq_id, ()))
            chunk.request.drafted_tokens += len(chunk.drafts)
            chunk.request.accepted_tokens += n
            self.verifications += 1
            self.drafted_tokens += len(chunk.drafts)
            self.accepted_tokens += n
            state = self._requests.get(chunk.request.seq_id)
            if state is not None:
                state.acceptance += SMOOTHING * (n / len(chunk.drafts) - state.acceptance)
        self.steps_drafted += drafted

    def release(self, req: Request) -> None:
        """Forget a finished request; its output joins its tenant's history where it opted in."""
        self._requests.pop(req.seq_id, None)
        if req.draft_history and req.tenant is not None and req.output_ids and self.enabled \
                and self.settings.history_tokens:
            history = self._histories.get(req.tenant)
            if history is None:
                history = self._histories[req.tenant] = TenantHistory(self.settings.history_tokens)
            history.add(req.output_ids)

    def snapshot(self) -> SpeculationSnapshot:
        return SpeculationSnapshot(self.method, self.drafted_tokens, self.accepted_tokens, self.verifications,
                                   self.steps_drafted, self.steps_off, self.off_reason)
