"""The one path every generation request takes, whatever its protocol:

    authorize (gateway: key, model, class) -> choose the model (routing: name, alias, route,
    fallback, ladder) -> prompts, grammar and thinking (the front-end's Shape.prepare) -> prepare
    (the model's door: every limit, once) -> charge the tenant (gateway) -> admit and submit
    (the door) -> gather one reply or stream events (streaming) -> the request's record

A cascade route: the small model's answer, or if it is unsure (its logprobs) the large one's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from aiohttp import web

from inferd.api.admission.ask import Ask
from inferd.api.errors import bad_request
from inferd.api.gateway.gate import GATEWAY
from inferd.api.gateway.keys import principal_of
from inferd.api.pipeline.prompts import make_prompts
from inferd.api.pipeline.shape import Reply, Shape
from inferd.api.record import RECORD, RequestRecord
from inferd.api.routing.holds import acquire
from inferd.api.routing.registry import Choice
from inferd.api.routing.routes import Caller
from inferd.api.state import SETTINGS
from inferd.api.streaming.generation import ChoiceResult, Generation, no_answer
from inferd.api.streaming.resume import RESUMABLE
from inferd.settings.policy import PriorityClass

ANSWERED_BY = web.RequestKey("answered_by", str)  # the x-inferd-model header: "name@revision"
FALLBACK_FROM = web.RequestKey("fallback_from", str)  # the x-inferd-fallback-from header
MAX_TOKENS_CLAMPED = web.RequestKey("max_tokens_clamped", int)  # the x-inferd-max-tokens-clamped header
CASCADE_TOKENS = web.RequestKey("cascade_tokens", int)  # a sure small answer's tokens

Unsure = Callable[[dict[int, ChoiceResult]], bool]


async def generate(request: web.Request, ask: Ask, shape: Shape) -> web.StreamResponse:
    """The whole of a generation request: who asks and where it goes, then its answer."""
    principal = principal_of(request)
    cls = request.app[GATEWAY].authorize(principal, ask.model, ask.priority)
    tenant = principal.tenant
    caller = Caller(cls.name, ask.user, tenant.name if tenant else None, tenant.tier if tenant else None)
    choice = await acquire(request, ask.model, caller)
    if choice.cascade is None:
        return await answer(request, ask, shape, choice, cls)
    if ask.stream:
        raise bad_request(f"{ask.model!r} is a cascade route, which answers whole: set stream to false",
                          param="stream", code="cascade_not_streamable")
    return await cascade(request, ask, shape, choice, cls)


async def answer(request: web.Request, ask: Ask, shape: Shape, choice: Choice, cls: PriorityClass, *,
                 unsure: Unsure | None = None) -> web.StreamResponse:
    """`choice`'s model answers (within the functional degradation's limits); with `unsure`, a
    non-streaming answer it finds unsure is not sent: CascadeUnsure is raised instead."""
    app = request.app
    served, model = choice.served, choice.slot.name
    if served.engine.limits.task == "embed":  # (a trunk: it has no head to sample text from)
        raise bad_request(f"the model {model!r} serves embeddings (task \"embed\"): ask /v1/embeddings",
                          param="model", code="wrong_task")
    tokenizer = served.engine.tokenizer
    max_prompts = app[SETTINGS].limits.max_prompts
    shaped = await make_prompts(request, tokenizer, served.engine.limits.max_model_len,
                                lambda guarded: shape.prepare(guarded, max_prompts))
    prompts = shaped.prompts
    # (what the shape made for this model goes to its door as data: a fallback's is its own)
    ask = dataclasses.replace(ask, grammar=shaped.grammar, thinking=shaped.thinking)
    if shaped.stop_token_ids:  # (the answer format's: harmony's)
        sampling = dataclasses.replace(ask.sampling, stop_token_ids=ask.sampling.stop_token_ids + shaped.stop_token_ids)
        ask = dataclasses.replace(ask, sampling=sampling)
    if unsure is not None:  # the cascade reads every token's logprob (not shown unless asked)
        ask = dataclasses.replace(ask, logprobs=max(ask.logprobs or 0, 0))
    principal = principal_of(request)  # (its tenant reaches admission on the Prepared)
    prepared = await served.door.prepare(ask, prompts, cls, choice.ceiling, choice.whole, tenant=principal.tenant)
    if ask.clamp_max_tokens and ask.max_tokens is not None and prepared.params.max_tokens < ask.max_tokens:
        request[MAX_TOKENS_CLAMPED] = prepared.params.max_tokens
    if ask.resumable:
        app[RESUMABLE].check_room()  # (429 before any charge; opening one checks again)
    # every check is passed: charge the tenant (its rate limits) before any queueing
    ticket = app[GATEWAY].charge(principal, prepared.cost)
    record = request_record(request, ask.user, lambda: shape.prompt_text(tokenizer, prompts))
    if record is not None:
        record.model, record.revision = served.spec.name, served.spec.revision
    request[ANSWERED_BY] = served.spec.label
    if choice.fallback_from is not None:
        request[FALLBACK_FROM] = choice.fallback_from
    with Generation(served.door, prepared, shape.id_prefix, record, ticket, ask.volatile_blocks) as gen:
        reply = Reply(gen.id, gen.created, model, tokenizer, gen.usage)
        if not ask.stream:
            results = await gen.gather(request)
            if results is None:
                return no_answer()
            if unsure is not None:
                if unsure(results):
                    raise CascadeUnsure()
                request[CASCADE_TOKENS] = gen.prompt_tokens + gen.completion_tokens
            return web.json_response(shape.whole(reply, results))
        events = shape.stream(reply)
        if events.background is not None:  # the events outlive this handler, in a task of their own
            return await events.background(gen.detach(request, events.head, events.render, events.tail,
                                                      events.dialect, events.per_token))
        return await gen.stream(request, events.head, events.render, events.tail, ask.resumable, events.dialect)


def request_record(request: web.Request, user: str | None, prompt_text: Callable[[], str]) -> RequestRecord | None:
    """The request's record (api/record.py), with its user, and its prompt if the settings say so."""
    record = request.get(RECORD)
    if record is not None:
        record.user = user
        if request.app[SETTINGS].server.log_prompts:
            record.prompt = prompt_text()
        if record.texts is not None:  # the request file is on (telemetry/request_file.py)
            record.texts.prompt = record.prompt or prompt_text()
    return record


class CascadeUnsure(Exception):
    """The small model's answer was unsure: not sent; the large model answers instead."""


async def cascade(request: web.Request, ask: Ask, shape: Shape, choice: Choice, cls: PriorityClass
                  ) -> web.StreamResponse:
    """The small model answers; if its answer is unsure (cascade.unsure on every choice's token
    logprobs), the large one answers instead. Counted on the small model's slot."""
    spec, small = choice.cascade, choice.slot
    assert spec is not None

    def unsure(results: dict[int, ChoiceResult]) -> bool:
        return any(spec.unsure([t.logprob for t in r.logprobs]) for r in results.values())

    try:
        response = await answer(request, ask, shape, choice, cls, unsure=unsure)
    except CascadeUnsure:
        small.counts.escalations += 1
        return await answer(request, ask, shape, await acquire(request, spec.large, Caller(cls.name)), cls)
    small.counts.tokens_saved += request.get(CASCADE_TOKENS, 0)  # what the large model would have computed
    return response
