"""The front door: every request's checks, its admission, and its submission, on the event loop.

    parsed body -> class -> check against EngineLimits -> admit (bounded queues) -> submit
                                                          ^                           |
                          leave  <-- the engine reports it scheduled, or it ended ----'

Validation happens here once, from the limits the engine publishes at start-up; the engine
does not check again. The door is the only owner of the admission counters: the engine thread
never writes them (it reports through `StepOutputs`, which arrive on this loop).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Sequence

from inferd.api.admission import Admission, AdmissionError
from inferd.api.errors import admission_error, bad_request
from inferd.engine.async_engine import AsyncEngine, RequestStream
from inferd.engine.grammar import GrammarCompiler
from inferd.engine.policy import PriorityClass, Timeouts
from inferd.engine.protocol import EngineRequest, LogitsConstraint
from inferd.model.sampling_params import SamplingParams


class FrontDoor:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.limits = engine.limits
        self.policy = engine.limits.policy
        self.admission = Admission(self.policy.classes)
        self.grammars = GrammarCompiler(engine.tokenizer, engine.limits.vocab_size)
        self.grammar_requests: Counter[str] = Counter()  # structured outputs by kind (api/structured.py)
        engine.prefill_listener = self.admission.record_prefill

    # ------------------------------------------------------------------------------ checks

    def priority_class(self, priority: str | int | None) -> PriorityClass:
        """The class a request's `priority` names (name, number, or None: the default); a 400
        naming the classes for one that does not exist."""
        try:
            return self.policy.lookup(priority)
        except KeyError:
            known = ", ".join(f"{c.name!r} ({c.priority})" for c in self.policy.ranked)
            raise bad_request(f"unknown priority {priority!r}; the classes are {known}", param="priority",
                              code="unknown_priority") from None

    def check_prompt(self, prompt_ids: Sequence[int], param: str) -> None:
        """A 400 for a prompt no request could run: empty, past the context, outside the vocabulary."""
        context, vocab = self.limits.max_model_len, self.limits.vocab_size
        if not prompt_ids:
            raise bad_request(f"the {param} is empty", param=param)
        if len(prompt_ids) >= context:
            raise bad_request(f"the {param} has {len(prompt_ids)} tokens; this model's context is {context} tokens",
                              param=param, code="context_length_exceeded")
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams, n: int, cls: PriorityClass) -> None:
        """A 400 for a request its class can never run (checked prompt, chosen max_tokens)."""
        if not 1 <= n <= self.limits.max_num_seqs:
            raise bad_request(f"n must be in [1, {self.limits.max_num_seqs}], got {n}", param="n")
        if params.logprobs is not None and self.limits.output_filter:
            # NOTE: their token strings come from token ids, around the filter: they would leak
            raise bad_request("logprobs are not available on this server: its output filter is on",
                              param="logprobs")
        if params.max_tokens > cls.max_tokens:
            raise bad_request(f"max_tokens must be at most {cls.max_tokens} in the {cls.name!r} class, "
                              f"got {params.max_tokens}", param="max_tokens")
        total = min(self.limits.max_model_len, len(prompt_ids) + params.max_tokens)
        capacity = self.limits.class_kv_tokens[cls.name]
        if total > capacity:
            # NOTE: it could never finish: it would preempt itself forever
            raise bad_request(f"the request needs up to {total} tokens of KV cache; the {cls.name!r} class may "
                              f"use {capacity} (lower max_tokens, or raise kv_cache_memory)", param="max_tokens")

    # --------------------------------------------------------------------------- admission

    def submit(self, prompts: Sequence[list[int]], params: SamplingParams, n: int, cls: PriorityClass,
               timeouts: Timeouts, tenant: str | None = None, tenant_weight: float = 1.0,
               constraints: Sequence[LogitsConstraint] | None = None, segment: str = "token") -> list[RequestStream]:
        """Check every prompt, admit them all into the class's queue (or none: 429 / 503), then
        submit one engine request per prompt (with its own constraint, if any); each leaves the
        queue when the engine schedules it or it ends first."""
        for prompt in prompts:
            self.check_request(prompt, params, n, cls)
        snapshot = self.engine.snapshot
        ttft = cls.timeouts.tightened(timeouts).ttft
        try:
            self.admission.admit(cls.name, len(prompts), sum(len(p) for p in prompts),
                                 shed_level=snapshot.shed_level, ttft_deadline=ttft,
                                 recover_seconds=self.policy.shedding.recover_seconds)
        except AdmissionError as e:
            raise admission_error(e) from None
        arrival = time.monotonic()
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                request = EngineRequest(self.engine.new_group_id(), prompt, params, cls.name, n, timeouts,
                                        arrival_time=arrival, tenant=tenant, tenant_weight=tenant_weight,
                                        constraint=constraints[i] if constraints else None, segment=segment)
                departure = functools.partial(self.admission.leave, cls.name, 1, len(prompt))
                streams.append(self.engine.submit(request, on_queue_exit=departure))
        except BaseException:
            for prompt in prompts[len(streams):]:  # never submitted: they leave at once
                self.admission.leave(cls.name, 1, len(prompt))
            for stream in streams:
                stream.abort()
            raise
        return streams

    def open(self) -> None:
        self.admission.open()

    def start_draining(self) -> None:
        """Refuse every new request from now on (503 with a Retry-After)."""
        self.admission.start_draining()

    @property
    def draining(self) -> bool:
        return self.admission.draining

    def rejections(self) -> dict[str, int]:
        """Requests refused so far, by reason (all classes)."""
        totals: dict[str, int] = {}
        for (_cls, reason), count in self.admission.rejections.items():
            totals[reason] = totals.get(reason, 0) + count
        return totals

