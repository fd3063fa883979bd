"""The one path both generation endpoints take (chat.py and completions.py only say how their
requests become prompts and how their answers are shaped):

    body -> model, n, class -> prompts (ResponseFormat) -> door: check, admit, submit
         -> gather (one JSON reply) or stream (SSE events) -> the request's log record

Every engine request a handler submits lives inside `Generation`'s `with` block, whose exit
aborts whatever is still running: a finished request ignores the abort, a disconnected or
cancelled client's request gives its KV blocks back at the engine's next step.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from pydantic import BaseModel

from inferd.api.auth import principal_of
from inferd.api.backpressure import bound_send_buffer, wait_for_reader
from inferd.api.body import read_json
from inferd.api.door import FrontDoor
from inferd.api.errors import APIError, bad_request, engine_abort_error, engine_failure_error, timeout_error
from inferd.api.logprobs import TokenTexts
from inferd.api.logs import RECORD, RequestRecord
from inferd.api.protocol import SamplingFields, Usage
from inferd.api.resume import caller_of, event_bound
from inferd.api.sse import EventSink, OutputQueue, dumps, write_events
from inferd.api.gateway import Ticket
from inferd.api.state import DOOR, ENGINE, GATEWAY, RESUMABLE, SETTINGS, SSE_RESPONSES, STATE, TOKEN_TEXTS
from inferd.api.structured import check_logit_bias, request_constraints
from inferd.config import Settings
from inferd.engine.async_engine import RequestStream
from inferd.engine.policy import PriorityClass, Timeouts
from inferd.engine.protocol import EngineOutput, LogitsConstraint, TokenLogprob
from inferd.model.sampling_params import SamplingParams
from inferd.model.tokenizer import Tokenizer

POLL_SECONDS = 1.0  # how often a non-streaming handler checks that its client is still there

Render = Callable[[int, EngineOutput], dict[str, Any] | str]


@dataclass
class ChoiceResult:
    """One choice, gathered for a non-streaming reply."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


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


def check_model(served: str, name: str) -> None:
    if name != served:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


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
    """The whole of a generation request, for either endpoint."""
    app = request.app
    door, gateway, settings, tokenizer = app[DOOR], app[GATEWAY], app[SETTINGS], app[ENGINE].tokenizer
    principal = principal_of(request)
    model = app[STATE].model_name
    check_model(model, body.model)
    gateway.check_model(principal, body.model)
    if body.n > settings.limits.max_n:
        raise bad_request(f"n must be in [1, {settings.limits.max_n}], got {body.n}", param="n")
    cls = door.priority_class(gateway.priority(principal, body.priority))
    gateway.check_class(principal, cls.name)
    prompts = fmt.prompts(tokenizer, body, settings.limits.max_prompts)
    context = door.limits.max_model_len
    for prompt in prompts:
        door.check_prompt(prompt, fmt.prompt_param)
    max_tokens = [resolve_max_tokens(fmt.max_tokens(body), len(p), context, settings,
                                     fit_default=fmt.fit_default, cls=cls, prompt_param=fmt.prompt_param)
                  for p in prompts]
    # NOTE: explicit or default, max_tokens is the same for every prompt once it fits them all
    params = sampling_params(body, max_tokens[0], fmt.logprobs(body))
    check_logit_bias(body, door.limits.vocab_size)
    constraints = await request_constraints(door, body, len(prompts))
    if body.resumable:
        app[RESUMABLE].check_room()  # (429 before any charge; opening one checks again)
    # every check is passed: charge the tenant (its rate limits) before any queueing
    ticket = gateway.admit(principal, sum(len(p) + params.max_tokens * body.n for p in prompts))
    record = request_record(request, body.user, lambda: fmt.prompt_text(tokenizer, body, prompts))
    token_text = app[TOKEN_TEXTS]
    with Generation(door, prompts, params, body.n, cls, request_timeouts(body), fmt.id_prefix, record,
                    constraints, ticket, segment=body.segment) as gen:
        if not body.stream:
            results = await gen.gather(request)
            if results is None:
                return no_answer()
            choices = [fmt.choice(body, token_text, index, result) for index, result in sorted(results.items())]
            reply = fmt.response_model(id=gen.id, created=gen.created, model=model, choices=choices,
                                       usage=Usage(**gen.usage()))
            return web.json_response(reply.model_dump(mode="json"))
        events = StreamEvents(fmt.object_name, gen.id, gen.created, model)

        def tail() -> list[dict[str, Any]]:
            return [events.event([], gen.usage())] if body.include_usage else []

        return await gen.stream(request, fmt.head(body, events), fmt.renderer(body, token_text, events), tail,
                                body.resumable)


# ---------------------------------------------------------------------------- generation


class Generation:
    """The engine requests of one HTTP request: one per prompt, each with n choices.

    `with Generation(...) as gen:` has the door check every prompt, admit them all into their
    class's queue (or none: 429 / 503), then submit them; leaving the block, however it is left,
    aborts what has not finished.
    """

    outlives_handler = False  # a resumable stream: its producer's task ends it, not the `with` block

    def __init__(self, door: FrontDoor, prompts: Sequence[list[int]], params: SamplingParams, n: int,
                 cls: PriorityClass, timeouts: Timeouts, id_prefix: str, record: RequestRecord | None = None,
                 constraints: Sequence[LogitsConstraint] | None = None, ticket: Ticket | None = None,
                 segment: str = "token") -> None:
        self.door = door
        self.ticket = ticket  # its tenant's account: refunded and counted at the end
        self.constraints = constraints  # one per prompt, for a structured output
        self.segment = segment  # "sentence" / "line": the engine holds text back; empty deltas are not sent
        self.prompts = prompts
        self.params = params
        self.n = n
        self.cls = cls
        self.timeouts = timeouts
        self.record = record  # the request's log line, filled in as outputs finish
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"  # the response's id
        if record is not None:
            record.id = self.id
        self.created = int(time.time())
        self.streams: list[RequestStream] = []
        self.completion_tokens = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def __enter__(self) -> Generation:
        ticket = self.ticket
        if self.record is not None:
            self.record.priority_class = self.cls.name
            self.record.prompt_tokens = self.prompt_tokens
        try:
            self.streams = self.door.submit(
                self.prompts, self.params, self.n, self.cls, self.timeouts, constraints=self.constraints,
                tenant=ticket.tenant.name if ticket else None, tenant_weight=ticket.tenant.weight if ticket else 1.0,
                segment=self.segment)
        except APIError as e:
            if ticket is not None:
                ticket.refused(e.code or "refused")
                ticket.close(0, 0)  # nothing ran: the whole charge goes back
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.record is not None:  # (the log line is written as the handler ends)
            self.record.completion_tokens = self.completion_tokens
        if not self.outlives_handler:  # a resumable stream's producer task ends it (resume.py)
            self.end()

    def end(self) -> None:
        """Abort what has not finished; the tenant's account counts the tokens, refunds the rest."""
        for stream in self.streams:
            stream.abort()
        if self.ticket is not None:
            self.ticket.close(self.prompt_tokens, self.completion_tokens)

    def _note(self, out: EngineOutput) -> None:
        """A finished choice's outcome and timings, for the request's log line and its tenant."""
        record, metrics = self.record, out.metrics
        if record is not None and record.texts is not None:  # every output's text, for the request file
            record.texts.add(out)
        if not out.finished:
            return
        if self.ticket is not None and metrics is not None:
            self.ticket.finished(metrics)
        if record is None:
            return
        record.finish.append(out.finish_reason or "-")
        if metrics is None:
            return
        record.cached_tokens += metrics.cached_tokens if out.index == 0 else 0
        record.preemptions += metrics.preemptions
        for name in ("queue_time", "ttft"):
            value, seen = getattr(metrics, name), getattr(record, name)
            if value is not None and (seen is None or value > seen):
                setattr(record, name, value)

    async def gather(self, request: web.Request) -> dict[int, ChoiceResult] | None:
        """Every choice's result by choice index (prompt * n + choice); None if the client left."""
        results = {p * self.n + i: ChoiceResult() for p in range(len(self.prompts)) for i in range(self.n)}
        outputs = OutputQueue(self.streams)
        try:
            while not outputs.done:
                batch = await outputs.next_batch(POLL_SECONDS)
                if client_gone(request):
                    return None
                for prompt, out in batch:
                    self._note(out)
                    if out.finish_reason in ("abort", "error"):
                        raise _ending_error(out)
                    result = results[prompt * self.n + out.index]
                    if out.finish_reason == "timeout" and not result.texts and not out.text:
                        raise timeout_error(out)  # nothing to show for it: an error, not a reply
                    result.texts.append(out.text)
                    self.completion_tokens += len(out.new_token_ids)
                    if out.logprobs:
                        result.logprobs += out.logprobs
                    if out.finished:
                        result.finish_reason = out.finish_reason
        finally:
            outputs.close()
        return results

    async def stream(self, request: web.Request, head: list[dict[str, Any]], render: Render,
                     tail: Callable[[], list[dict[str, Any]]], resumable: bool = False) -> web.StreamResponse:
        """Answer with SSE: the `head` events, one `render(prompt, output)` event per output
        (one per token, even when the detokenizer holds its text back), the `tail()` events,
        then `data: [DONE]`. An engine abort (shutdown) ends the stream with an error event.
        Written straight to the socket (sse.py); a `resumable` stream's events are produced by a
        task of their own that outlives a disconnect, into a buffer its writers copy (resume.py)."""
        keepalive = request.app[SETTINGS].server.keepalive_seconds

        async def produce(events: EventSink) -> None:
            outputs = OutputQueue(self.streams)
            try:
                for payload in head:
                    events.add(payload)
                await events.flush()
                if await self._stream_outputs(outputs, events, render, keepalive):
                    for payload in tail():
                        events.add(payload)
            finally:
                outputs.close()

        if not resumable:
            server = request.app[SETTINGS].server
            bound_send_buffer(request, server.stream_send_buffer_bytes)
            guard = functools.partial(wait_for_reader, request, self.streams, server.slow_client_seconds,
                                      request.app[STATE].slow_clients)
            return await write_events(request, self.id, produce, request.app[SSE_RESPONSES], guard)
        bound = event_bound(len(head), len(self.prompts) * self.n, self.params.max_tokens)
        stream = request.app[RESUMABLE].open(self.id, caller_of(request), bound, produce, self.end)
        self.outlives_handler = True
        return await stream.serve(request, -1)

    async def _stream_outputs(self, outputs: OutputQueue, events: EventSink, render: Render,
                              keepalive: float) -> bool:
        """Write every output as it comes; False if an engine abort or failure cut the stream short."""
        while not outputs.done:
            batch = await outputs.next_batch(keepalive)
            if not batch:
                await events.keepalive()
                continue
            for prompt, out in batch:
                self._note(out)
                if out.finish_reason in ("abort", "error"):  # the response ends here
                    events.add(_ending_error(out).body())
                    return False
                self.completion_tokens += len(out.new_token_ids)
                if not out.text and self.segment != "token" and not out.finished and not out.logprobs:
                    continue  # segmented: no event for a token whose text is held back
                events.add(render(prompt, out))
                if out.finish_reason == "timeout":  # after the choice's last chunk, say which
                    events.add(timeout_error(out).body())
            await events.flush()
        return True


def _ending_error(out: EngineOutput) -> APIError:
    """Why a choice ended without an answer: an engine abort (shutdown) or a failure."""
    return engine_abort_error(out) if out.finish_reason == "abort" else engine_failure_error(out)


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def no_answer() -> web.Response:
    """What a handler returns when its client already left (nobody reads it)."""
    return web.Response(status=499, reason="Client Closed Request")
