"""A model's door: every limit of a request checked once, then its admission and submission, on
the event loop.

    Ask + prompt ids --prepare--> Prepared --admit--> class queue (bounded) --submit--> engine
                       (400s)                 (429 / 503)    ^                           |
                             leave  <-- the engine reports it scheduled, or it ended ----'

`prepare` checks, in order: each prompt (empty, past the context, outside the vocabulary); `n`;
max_tokens (the server's limit, the default fitted to the context, the context, the functional
ladder's ceiling, the class's ceiling, the class's KV capacity); logprobs against the output
filter; the sampling values; logit_bias against the vocabulary; the grammar the front-end's shape
made (its text compiled off the loop), within a thinking budget if one is asked; then the
session it names is scoped to its tenant (`session`). A pooling
request (embeddings, scores: its prompt only) is checked for what it is instead: each prompt
against what the model reads at once, one choice, the class's KV capacity. Each check reads
the limits the engine published at start-up; nothing after `prepare` checks again, and the engine
only asserts. The door is the only owner of its class queues: the engine thread never writes them
(it reports through `StepOutputs`, arriving on this loop).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from inferd.api.admission.ask import Ask, Grammar, Prepared, Refused, SessionAsk, Thinking
from inferd.api.admission.queues import AdmissionError, ClassQueues
from inferd.api.errors import APIError, bad_request
from inferd.api.gateway.tenants import Tenant
from inferd.api.state import ServerState
from inferd.engine.async_engine import AsyncEngine, RequestStream
from inferd.engine.protocol import EngineLimits, EngineRequest, LogitsConstraint, Session
from inferd.engine.structured.budget import ReasoningBudget
from inferd.engine.structured.grammar import GrammarCompiler, GrammarError
from inferd.text.sampling_params import SamplingParams
from inferd.settings.config import CacheSettings, LimitSettings
from inferd.settings.policy import PriorityClass, SchedulingPolicy

MAX_GRAMMAR_CHARS = 64 * 1024  # a larger schema or grammar is refused before it is compiled


@dataclass
class DoorCounts:
    """A model's refusals at its door and its structured outputs by kind. The model's slot owns
    them and hands them to each revision's door, so a reload keeps counting where it was."""

    rejections: Counter[tuple[str, str]] = field(default_factory=Counter)  # (class, reason)
    grammars: Counter[str] = field(default_factory=Counter)  # by GRAMMAR_KINDS

    def rejections_by_reason(self) -> dict[str, int]:
        totals: Counter[str] = Counter()
        for (_cls, reason), count in self.rejections.items():
            totals[reason] += count
        return dict(totals)


class FrontDoor:
    def __init__(self, engine: AsyncEngine, server: ServerState, settings: LimitSettings,
                 counts: DoorCounts | None = None, cache: CacheSettings | None = None) -> None:
        self.engine = engine
        self.limits: EngineLimits = engine.limits
        self.settings = settings
        self.cache = cache or CacheSettings()  # (the sessions' TTLs)
        self.server = server  # (whether it drains)
        self.counts = counts or DoorCounts()
        self.queues = ClassQueues(self.limits.policy.classes, rejections=self.counts.rejections)
        self.grammars = GrammarCompiler(engine.tokenizer, self.limits.vocab_size)
        engine.prefill_listener = self.queues.record_prefill

    # ------------------------------------------------------------------------------ checks

    async def prepare(self, ask: Ask, prompts: Sequence[list[int]], cls: PriorityClass,
                      ceiling: int | None = None, whole: bool = False, tenant: Tenant | None = None) -> Prepared:
        """Every limit of the request, once (the module's docstring has the order): a 400 that
        names the field, else what the engine will run, for `tenant` (None: a caller without
        one). `ceiling` and `whole` are the functional degradation ladder's: max_tokens at most
        this, a stream answered in one piece."""
        if ask.pooling is not None:
            return self.prepare_pooling(ask, prompts, cls, tenant)
        for prompt in prompts:
            self.check_prompt(prompt, ask.prompt_param)
        bound = min(self.settings.max_n, self.limits.max_num_seqs)
        if not 1 <= ask.n <= bound:
            raise bad_request(f"n must be in [1, {bound}], got {ask.n}", param="n")
        longest = max(len(p) for p in prompts)
        max_tokens = self.max_tokens(ask, longest, cls, ceiling)
        if ask.logprobs is not None and self.limits.output_filter:
            # NOTE: their token strings come from token ids, around the filter: they would leak
            raise bad_request("logprobs are not available on this server: its output filter is on",
                              param="logprobs")
        params = _sampling_params(ask, max_tokens)
        vocab = self.limits.vocab_size
        bad = [token for token, _ in params.logit_bias if not 0 <= token < vocab]
        if bad:
            raise bad_request(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})",
                              param="logit_bias")
        return Prepared(prompts=prompts, params=params, n=ask.n, cls=cls,
                        timeouts=cls.timeouts.tightened(ask.timeouts),
                        segment="whole" if whole and ask.stream else ask.segment,
                        constraints=await self._constraints(ask, len(prompts)), cache_salt=ask.cache_salt,
                        tenant=tenant, session=self.session(ask.session, cls, tenant))

    def session(self, asked: SessionAsk | None, cls: PriorityClass, tenant: Tenant | None) -> Session | None:
        """The engine's session for what a request named: its key in its tenant's scope (two
        tenants' equal keys never meet), its TTL the one asked or cache.session_ttl_seconds, at
        most cache.session_max_ttl_seconds, its priority its class's rank."""
        if asked is None:
            return None
        ttl = self.cache.session_ttl_seconds if asked.ttl is None else asked.ttl
        return Session(f"{tenant.name if tenant else ''}\x00{asked.key}", min(ttl, self.cache.session_max_ttl_seconds),
                       class_rank(self.limits.policy, cls))

    def prepare_pooling(self, ask: Ask, prompts: Sequence[list[int]], cls: PriorityClass,
                        tenant: Tenant | None) -> Prepared:
        """A prompt-only request (Ask.pooling): each prompt within what the model reads at once
        (its pooler's limit for embeddings; for scores the context, less the one position every
        request holds), n = 1 and max_tokens 1 (nothing is sampled: no grammar, no sampling
        values), and the class able to hold the longest. The front-end checked the model's task."""
        assert ask.pooling is not None
        pooler, param = self.limits.pooler, ask.prompt_param
        assert ask.pooling.task == "score" or pooler is not None, "embeddings from a model without a pooler"
        longest = pooler.max_prompt_tokens if ask.pooling.task == "embed" and pooler else self.limits.max_model_len - 1
        for i, prompt in enumerate(prompts):
            if len(prompt) > longest:
                which = f"{param}[{i}]" if len(prompts) > 1 else f"the {param}"
                raise bad_request(f"{which} has {len(prompt)} tokens; this model reads at most {longest} tokens at "
                                  "once", param=param, code="context_length_exceeded")
            self.check_prompt(prompt, param)
        if ask.n != 1:
            raise bad_request(f"n must be 1 for a pooling request, got {ask.n}", param="n")
        total, capacity = max(len(p) for p in prompts) + 1, self.limits.class_kv_tokens[cls.name]
        if total > capacity:  # (it could never be scheduled: it would preempt itself forever)
            raise bad_request(f"an input needs {total} tokens of KV cache; the {cls.name!r} class may use {capacity}",
                              param=param)
        return Prepared(prompts=prompts, params=SamplingParams(max_tokens=1), n=1, cls=cls,
                        timeouts=cls.timeouts.tightened(ask.timeouts), segment="token", constraints=None,
                        cache_salt=ask.cache_salt, tenant=tenant, pooling=ask.pooling)

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

    def max_tokens(self, ask: Ask, prompt_len: int, cls: PriorityClass, ceiling: int | None = None) -> int:
        """The max_tokens to run with, or a 400 naming the numbers that do not fit.

        A default (no max_tokens asked) is limits.max_tokens_default, at most the class's ceiling,
        clipped to what is left of the context when `ask.fit_default` (chat); an explicit one must
        fit as asked, unless `ask.clamp_max_tokens` lowers it to every limit first. The ladder's
        `ceiling` then caps it, and the class must hold the rest.
        """
        requested, context, limit = ask.max_tokens, self.limits.max_model_len, self.settings.max_tokens_limit
        if requested is not None and ask.clamp_max_tokens:
            room = min(context, self.limits.class_kv_tokens[cls.name]) - prompt_len
            requested = max(1, min(requested, limit, cls.max_tokens, room))
        if requested is not None and requested > limit:
            raise bad_request(f"max_tokens must be at most {limit}, got {requested}", param="max_tokens")
        max_tokens = requested if requested is not None else min(self.settings.max_tokens_default, cls.max_tokens)
        if requested is None and ask.fit_default:
            max_tokens = min(max_tokens, context - prompt_len)
        if prompt_len + max_tokens > context:
            raise bad_request(
                f"the {ask.prompt_param} has {prompt_len} tokens and max_tokens is {max_tokens}: "
                f"{prompt_len + max_tokens} tokens do not fit this model's context of {context} tokens",
                param="max_tokens", code="context_length_exceeded",
            )
        if ceiling is not None:
            max_tokens = min(max_tokens, ceiling)
        if max_tokens > cls.max_tokens:
            raise bad_request(f"max_tokens must be at most {cls.max_tokens} in the {cls.name!r} class, "
                              f"got {max_tokens}", param="max_tokens")
        total = min(context, prompt_len + max_tokens)
        capacity = self.limits.class_kv_tokens[cls.name]
        if total > capacity:
            # NOTE: it could never finish: it would preempt itself forever
            raise bad_request(f"the request needs up to {total} tokens of KV cache; the {cls.name!r} class may "
                              f"use {capacity} (lower max_tokens, or raise kv_cache_memory)", param="max_tokens")
        return max_tokens

    async def _constraints(self, ask: Ask, prompts: int) -> list[LogitsConstraint] | None:
        """One fresh constraint per prompt (the grammar's, within a thinking budget if one is
        asked), or None for free text; a 400 naming the field for a grammar that does not
        compile or cannot hold with the other fields."""
        first = await self._grammar(ask)
        if ask.thinking is not None:
            first = self._budget(ask.thinking, first)
        if first is None:
            return None
        return [first] + [first.fork() for _ in range(prompts - 1)]

    async def _grammar(self, ask: Ask) -> LogitsConstraint | None:
        grammar = ask.grammar
        if grammar is None:
            return None
        try:
            if isinstance(grammar, Refused):  # the shape could not build it: its 400, in this turn
                raise grammar.error
            if ask.sampling.ignore_eos and grammar.ends_answer:
                raise bad_request(f"ignore_eos cannot be combined with {grammar.param}: the grammar ends the answer",
                                  param="ignore_eos")
            first = await self._compile(grammar)
        except APIError:
            self.counts.grammars["invalid"] += 1
            raise
        if first is not None:
            self.counts.grammars[grammar.kind] += 1
        return first

    def _budget(self, thinking: Thinking, inner: LogitsConstraint | None) -> LogitsConstraint:
        """`inner` (or free text) within a thinking budget."""
        tokenizer = self.engine.tokenizer
        special = tokenizer.special_ids

        def token_bytes(token: int) -> bytes:
            return tokenizer.id_to_token(token).encode() if token in special else tokenizer.token_bytes(token)

        return ReasoningBudget(thinking.budget, tokenizer.encode(thinking.closing, add_special_tokens=False),
                               thinking.open.encode(), thinking.close.encode(), thinking.inside, token_bytes, inner)

    async def _compile(self, grammar: Grammar) -> LogitsConstraint | None:
        """The grammar's constraint; a 400 for one too large or that does not compile, or, for a
        `best_effort` one, None: the answer goes unconstrained (an agent's many large tool schemas
        must not turn "auto" into a refusal)."""
        if len(grammar.text) > MAX_GRAMMAR_CHARS:
            problem = (f"the {grammar.param} grammar is too large ({len(grammar.text)} characters; at most "
                       f"{MAX_GRAMMAR_CHARS})")
        else:
            try:
                return await asyncio.to_thread(self.grammars.compile, grammar.text, grammar.repeat_tags,
                                               grammar.best_effort)
            except GrammarError as e:
                problem = f"the {grammar.param} cannot be compiled: {e}"
        if grammar.best_effort:
            return None
        raise bad_request(problem, param=grammar.param, code="invalid_grammar")

    # --------------------------------------------------------------------------- admission

    def admit(self, prepared: Prepared) -> list[RequestStream]:
        """Admit every prompt into the class's queue (or none: 429 / 503), then submit one engine
        request per prompt (with its own constraint, if any, and the prefix-cache namespace of
        its tenant's scope and its cache_salt); each leaves the queue when the engine schedules
        it or it ends first. Nothing is checked again: `prepare` did."""
        cls, prompts, tenant = prepared.cls, prepared.prompts, prepared.tenant
        try:
            self.queues.enter(cls.name, len(prompts), prepared.prompt_tokens, draining=self.server.draining,
                              shed_level=self.engine.snapshot.shed_level, ttft_deadline=prepared.timeouts.ttft,
                              recover_seconds=self.limits.policy.shedding.recover_seconds)
        except AdmissionError as e:
            raise admission_error(e) from None
        arrival = time.monotonic()
        salt = cache_namespace(tenant.cache_scope if tenant else "", prepared.cache_salt)
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                request = EngineRequest(self.engine.new_group_id(), prompt, prepared.params, cls.name, prepared.n,
                                        prepared.timeouts, arrival_time=arrival, tenant=tenant.name if tenant else None,
                                        tenant_weight=tenant.weight if tenant else 1.0, segment=prepared.segment,
                                        cache_salt=salt, pooling=prepared.pooling, session=prepared.session,
                                        draft_history=tenant is not None and tenant.speculative_history,
                                        constraint=prepared.constraints[i] if prepared.constraints else None)
                departure = functools.partial(self.queues.leave, cls.name, 1, len(prompt))
                streams.append(self.engine.submit(request, on_queue_exit=departure))
        except BaseException:
            for prompt in prompts[len(streams):]:  # never submitted: they leave at once
                self.queues.leave(cls.name, 1, len(prompt))
            for stream in streams:
                stream.abort()
            raise
        return streams


def cache_namespace(scope: str, salt: str | None) -> bytes:
    """A request's prefix-cache namespace: its tenant's (or cache group's) scope, narrowed by its
    own cache_salt. b"" (the one shared namespace) for a keyless or plain-key caller without a
    salt. Hashed, so that no scope and salt can be chosen to meet another's."""
    if not scope and salt is None:
        return b""
    return hashlib.blake2b(f"{scope}\0{salt or ''}".encode(), digest_size=16, person=b"inferd-kv-ns").digest()


def class_rank(policy: SchedulingPolicy, cls: PriorityClass) -> int:
    """A class's rank among the policy's: 0 for the least important, higher for more important
    (a lower `priority` number runs first)."""
    ranked = [c.name for c in policy.ranked]  # (most important first)
    return len(ranked) - 1 - ranked.index(cls.name)


def _sampling_params(ask: Ask, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=ask.logprobs, **dataclasses.asdict(ask.sampling))
    except ValueError as e:  # the protocol's ranges should have caught it; still the client's
        raise bad_request(str(e)) from None


def admission_error(e: AdmissionError) -> APIError:
    """A refusal at the door: 429 (queue full, shed, predicted deadline miss) or 503 (draining),
    with when to come back; 400 for a request too large for its class's queue ever to hold."""
    if e.oversized:
        return bad_request(e.message, param="prompt", code="queue_too_small")
    return APIError(e.status, e.message, type="rate_limit_error" if e.status == 429 else None,
                    code=e.reason, headers={"Retry-After": str(e.retry_after)})
