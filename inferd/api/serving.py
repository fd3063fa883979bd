"""The one path both generation endpoints take (chat.py and completions.py only say how their
requests become prompts and how their answers are shaped):

    body -> class -> model (fleet.py: name, alias, route; a fallback while degraded)
         -> prompts (ResponseFormat) -> that model's door: check, admit, submit
         -> gather (one JSON reply) or stream (SSE events) -> the request's log record
    a cascade route: the small model's answer, or if unsure (its logprobs) the large one's

The engine requests themselves, from admission to their end, are generation.py's `Generation`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from pydantic import BaseModel

from inferd.api.auth import principal_of
from inferd.api.body import read_json
from inferd.api.errors import bad_request
from inferd.api.fleet import ANSWERED_BY, CASCADE_TOKENS, FALLBACK_FROM, FLEET, Choice, Fleet, degradation_steps
from inferd.api.generation import ChoiceResult, Generation, Render, no_answer
from inferd.api.logprobs import TokenTexts
from inferd.api.logs import RECORD, RequestRecord
from inferd.api.protocol import SamplingFields, Usage
from inferd.api.routing import Caller
from inferd.api.sse import dumps
from inferd.api.state import GATEWAY, RESUMABLE, SETTINGS
from inferd.api.structured import check_logit_bias, request_constraints
from inferd.config import Settings
from inferd.engine.policy import PriorityClass, Timeouts
from inferd.model.sampling_params import SamplingParams
from inferd.model.tokenizer import Tokenizer


class StreamEvents:
    """The payloads of one streamed response: whole events, and the JSON head that per-token
    events are written from (only the choice's fields after it vary)."""

    def __init__(self, object_name: str, completion_id: str, created: int, model: str) -> None:
        self._base = {"id": completion_id, "object": object_name, "created": created, "model": model}
        self.token_head = dumps({**self._base, "choices": []})[: -len("[]}")] + '[{"index":'

    def event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        payload = {**self._base, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return payload

    def token_event(self, index: int, content: str, finish_reason: str | None) -> str:
        """One choice's per-token event without logprobs, as JSON text; `content` is its
        `"text":...` or `"delta":...` member, already JSON."""
        return f'{self.token_head}{index},{content},"logprobs":null,"finish_reason":{dumps(finish_reason)}}}]}}'


class ResponseFormat(Protocol):
    """What differs between /v1/completions and /v1/chat/completions."""

    id_prefix: str  # of the response id: "cmpl", "chatcmpl"
    object_name: str  # of a streamed chunk
    prompt_param: str  # the field an error about the prompt names
    fit_default: bool  # a default max_tokens is clipped to the context left (chat)

    def prompts(self, tokenizer: Tokenizer, body: Any, max_prompts: int) -> list[list[int]]: ...

    def max_tokens(self, body: Any) -> int | None: ...

    def logprobs(self, body: Any) -> int | None: ...

    def prompt_text(self, tokenizer: Tokenizer, body: Any, prompts: list[list[int]]) -> str: ...

    response_model: type[BaseModel]  # of a non-streamed reply: id, created, model, choices, usage

    def choice(self, body: Any, token_text: TokenTexts, index: int, result: ChoiceResult) -> BaseModel: ...

    def head(self, body: Any, events: StreamEvents) -> list[dict[str, Any]]: ...

    def renderer(self, body: Any, token_text: TokenTexts, events: StreamEvents) -> Render: ...


# --------------------------------------------------------------------------------- checks


def request_timeouts(body: SamplingFields) -> Timeouts:
    return Timeouts(queue=body.queue_timeout, ttft=body.ttft_timeout, token=body.token_timeout,
                    total=body.total_timeout)


def resolve_max_tokens(requested: int | None, prompt_len: int, context: int, settings: Settings, *,
                       fit_default: bool, cls: PriorityClass, prompt_param: str) -> int:
    """The max_tokens to run with, or a 400 naming the numbers that do not fit.

    A default (no max_tokens in the request) is limits.max_tokens_default, at most the class's
    ceiling, clipped to what is left of the context when `fit_default` (chat); an explicit one
    must fit as asked (the class's ceiling is the door's check).
    """
    limit = settings.limits.max_tokens_limit
    if requested is not None and requested > limit:
        raise bad_request(f"max_tokens must be at most {limit}, got {requested}", param="max_tokens")
    max_tokens = requested if requested is not None else min(settings.limits.max_tokens_default, cls.max_tokens)
    if requested is None and fit_default:
        max_tokens = min(max_tokens, context - prompt_len)
    if prompt_len + max_tokens > context:
        raise bad_request(
            f"the {prompt_param} has {prompt_len} tokens and max_tokens is {max_tokens}: "
            f"{prompt_len + max_tokens} tokens do not fit this model's context of {context} tokens",
            param="max_tokens", code="context_length_exceeded",
        )
    return max_tokens


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
            min_p=body.min_p, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            seed=body.seed, logprobs=logprobs, stop=body.stop_strings, ignore_eos=body.ignore_eos,
            logit_bias=body.token_bias,
        )
    except ValueError as e:  # the protocol's ranges should have caught it; still the client's
        raise bad_request(str(e)) from None


def request_record(request: web.Request, user: str | None, prompt_text: Callable[[], str]) -> RequestRecord | None:
    """The request's log line (see logs.py), with its user, and its prompt if the settings say so."""
    record = request.get(RECORD)
    if record is not None:
        record.user = user
        if request.app[SETTINGS].server.log_prompts:
            record.prompt = prompt_text()
        if record.texts is not None:  # the request file is on (request_log.py)
            record.texts.prompt = record.prompt or prompt_text()
    return record


# ---------------------------------------------------------------------------- the handler


def endpoint(request_model: type[SamplingFields], fmt: ResponseFormat) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The aiohttp handler of one generation endpoint."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await generate(request, request_model.model_validate(await read_json(request)), fmt)

    return handle


async def generate(request: web.Request, body: SamplingFields, fmt: ResponseFormat) -> web.StreamResponse:
    """The whole of a generation request, for either endpoint: where it goes, then its answer."""
    app = request.app
    gateway, settings, fleet = app[GATEWAY], app[SETTINGS], app[FLEET]
    principal = principal_of(request)
    gateway.check_model(principal, body.model)
    if body.n > settings.limits.max_n:
        raise bad_request(f"n must be in [1, {settings.limits.max_n}], got {body.n}", param="n")
    cls = fleet.primary.current.door.priority_class(gateway.priority(principal, body.priority))
    gateway.check_class(principal, cls.name)
    tenant = principal.tenant
    choice = fleet.choose(body.model, Caller(cls.name, body.user, tenant.name if tenant else None,
                                             tenant.tier if tenant else None))
    if choice.cascade is None:
        return await answer(request, body, fmt, choice, cls)
    if body.stream:
        raise bad_request(f"{body.model!r} is a cascade route, which answers whole: set stream to false",
                          param="stream", code="cascade_not_streamable")
    return await cascade(request, body, fmt, fleet, choice, cls)


async def answer(request: web.Request, body: SamplingFields, fmt: ResponseFormat, choice: Choice,
                 cls: PriorityClass, *, unsure: Callable[[dict[int, ChoiceResult]], bool] | None = None
                 ) -> web.StreamResponse:
    """`choice`'s model answers (within the functional degradation's limits); with `unsure`, a
    non-streaming answer it finds unsure is not sent: CascadeUnsure is raised instead."""
    app = request.app
    gateway, settings = app[GATEWAY], app[SETTINGS]
    served, model = choice.served, choice.slot.name
    door, tokenizer = served.door, served.engine.tokenizer
    prompts = fmt.prompts(tokenizer, body, settings.limits.max_prompts)
    for prompt in prompts:
        door.check_prompt(prompt, fmt.prompt_param)
    max_tokens = [resolve_max_tokens(fmt.max_tokens(body), len(p), door.limits.max_model_len, settings,
                                     fit_default=fmt.fit_default, cls=cls, prompt_param=fmt.prompt_param)
                  for p in prompts]
    degraded = degradation_steps(choice, cls, settings)
    # NOTE: explicit or default, max_tokens is the same for every prompt once it fits them all
    logprobs = fmt.logprobs(body) if unsure is None else max(fmt.logprobs(body) or 0, 0)
    params = sampling_params(body, degraded.max_tokens(max_tokens[0]), logprobs)
    check_logit_bias(body, door.limits.vocab_size)
    constraints = await request_constraints(door, body, len(prompts))
    if body.resumable:
        app[RESUMABLE].check_room()  # (429 before any charge; opening one checks again)
    # every check is passed: charge the tenant (its rate limits) before any queueing
    ticket = gateway.admit(principal_of(request), sum(len(p) + params.max_tokens * body.n for p in prompts))
    record = request_record(request, body.user, lambda: fmt.prompt_text(tokenizer, body, prompts))
    if record is not None:
        record.model, record.revision = served.spec.name, served.spec.revision
    token_text = served.token_texts
    request[ANSWERED_BY] = served.spec.label
    if choice.fallback_from is not None:
        request[FALLBACK_FROM] = choice.fallback_from
    with Generation(door, prompts, params, body.n, cls, request_timeouts(body), fmt.id_prefix, record,
                    constraints, ticket, segment=degraded.segment(body)) as gen:
        if not body.stream:
            results = await gen.gather(request)
            if results is None:
                return no_answer()
            if unsure is not None:
                if unsure(results):
                    raise CascadeUnsure()
                request[CASCADE_TOKENS] = gen.prompt_tokens + gen.completion_tokens
            choices = [fmt.choice(body, token_text, index, result) for index, result in sorted(results.items())]
            reply = fmt.response_model(id=gen.id, created=gen.created, model=model, choices=choices,
                                       usage=Usage(**gen.usage()))
            return web.json_response(reply.model_dump(mode="json"))
        events = StreamEvents(fmt.object_name, gen.id, gen.created, model)

        def tail() -> list[dict[str, Any]]:
            return [events.event([], gen.usage())] if body.include_usage else []

        return await gen.stream(request, fmt.head(body, events), fmt.renderer(body, token_text, events), tail,
                                body.resumable)


class CascadeUnsure(Exception):
    """The small model's answer was unsure: not sent; the large model answers instead."""


async def cascade(request: web.Request, body: SamplingFields, fmt: ResponseFormat, fleet: Fleet, choice: Choice,
                  cls: PriorityClass) -> web.StreamResponse:
    """The small model answers; if its answer is unsure (cascade.unsure on every choice's token
    logprobs), the large one answers instead. Counted on the small model's slot."""
    spec, small = choice.cascade, choice.slot
    assert spec is not None

    def unsure(results: dict[int, ChoiceResult]) -> bool:
        return any(spec.unsure([t.logprob for t in r.logprobs]) for r in results.values())

    try:
        response = await answer(request, body, fmt, choice, cls, unsure=unsure)
    except CascadeUnsure:
        small.counts.escalations += 1
        return await answer(request, body, fmt, fleet.choose(spec.large, Caller(cls.name)), cls)
    small.counts.tokens_saved += request.get(CASCADE_TOKENS, 0)  # what the large model would have computed
    return response
