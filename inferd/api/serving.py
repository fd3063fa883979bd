"""What the completion and chat handlers share: app keys, request checks, the sampling
parameters, the life of the engine requests behind one HTTP request, and the two ways of
answering (gather everything, or stream events).

Every engine request a handler submits lives inside `Generation`'s `with` block, whose exit
aborts whatever is still running: a finished request ignores the abort, a disconnected or
cancelled client's request gives its KV blocks back at the engine's next step.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientConnectionResetError, web

from inferd.api.errors import APIError, bad_request
from inferd.api.logs import RECORD, RequestRecord
from inferd.api.protocol import SamplingFields
from inferd.api.sse import EventStream, OutputQueue, dumps
from inferd.config import Settings
from inferd.engine.admission import AdmissionError
from inferd.engine.engine import AsyncEngine, RequestStream
from inferd.engine.llm_engine import RequestError, RequestOutput, TokenLogprob
from inferd.engine.policy import PriorityClass, Timeouts
from inferd.model.sampling_params import SamplingParams
from inferd.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0  # JSON has no -Infinity; a masked alternative reports this instead
POLL_SECONDS = 1.0  # how often a non-streaming handler checks that its client is still there


class TokenTexts:
    """Token id -> (display text, UTF-8 bytes) for logprobs, cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._tokenizer.token_bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit


@dataclass
class ServerState:
    """The server's life, for /ready and /v1/status; written on the event loop only."""

    started: float = field(default_factory=time.monotonic)
    probed: bool = False  # the start-up inference probe has passed
    probe_error: str | None = None  # the last probe's failure, if it failed
    draining: bool = False
    drain_cut: int = 0  # requests still running when the drain's grace period ended

    def name(self, engine_alive: bool) -> str:
        if self.draining:
            return "draining"
        if not engine_alive or self.probe_error is not None:
            return "not_ready"
        return "ready" if self.probed else "loading"


ENGINE = web.AppKey("engine", AsyncEngine)
STATE = web.AppKey("state", ServerState)
SETTINGS = web.AppKey("settings", Settings)
TOKEN_TEXTS = web.AppKey("token_texts", TokenTexts)
SSE_RESPONSES = web.AppKey("sse_responses", set[web.StreamResponse])  # open streams, for shutdown


# --------------------------------------------------------------------------------- checks


def _reject_constant(name: str) -> None:
    raise ValueError(f"invalid JSON: {name} is not a number")


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (NaN / Infinity refused); errors become 400s in errors.py."""
    body = await request.read()
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the constants above
        raise bad_request(f"invalid JSON in the request body: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


def check_model(engine: AsyncEngine, name: str) -> None:
    if name != engine.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {engine.model_name!r}",
                       param="model", code="model_not_found")


def check_n(settings: Settings, n: int) -> None:
    if n > settings.limits.max_n:
        raise bad_request(f"n must be in [1, {settings.limits.max_n}], got {n}", param="n")


def priority_class(engine: AsyncEngine, body: SamplingFields) -> PriorityClass:
    """The request's class (400 for a name or number no class has)."""
    try:
        return engine.engine.resolve_class(body.priority)
    except RequestError as e:
        raise bad_request(str(e), param="priority", code="unknown_priority") from None


def request_timeouts(body: SamplingFields) -> Timeouts:
    return Timeouts(queue=body.queue_timeout, ttft=body.ttft_timeout, token=body.token_timeout,
                    total=body.total_timeout)


def resolve_max_tokens(
    requested: int | None, prompt_len: int, context: int, settings: Settings, *, fit_default: bool,
    prompt_param: str, cls: PriorityClass,
) -> int:
    """The max_tokens to run with, or a 400 naming the numbers that do not fit.

    A default (no max_tokens in the request) is limits.max_tokens_default, at most the class's
    ceiling, clipped to what is left of the context when `fit_default` (chat); an explicit one
    must fit as asked (the class's ceiling is the engine's check).
    """
    if prompt_len == 0:
        raise bad_request(f"the {prompt_param} is empty", param=prompt_param)
    if prompt_len >= context:
        raise bad_request(f"the {prompt_param} has {prompt_len} tokens; this model's context is {context} tokens",
                          param=prompt_param, code="context_length_exceeded")
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
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            seed=body.seed,
            logprobs=logprobs,
            stop=body.stop_strings,
            ignore_eos=body.ignore_eos,
        )
    except ValueError as e:  # the protocol's ranges should have caught it; still the client's
        raise bad_request(str(e)) from None


# ---------------------------------------------------------------------------- generation


@dataclass
class ChoiceResult:
    """One choice, gathered for a non-streaming reply."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


def request_record(request: web.Request, user: str | None, prompt_text: Callable[[], str]) -> RequestRecord | None:
    """The request's log line (see logs.py), with its user, and its prompt if the settings say so."""
    record = request.get(RECORD)
    if record is not None:
        record.user = user
        if request.app[SETTINGS].server.log_prompts:
            record.prompt = prompt_text()
    return record


class Generation:
    """The engine requests of one HTTP request: one per prompt, each with n choices.

    `with Generation(...) as gen:` checks every prompt, admits them all into their class's
    queue (or none: 429 / 503), then submits them; leaving the block, however it is left,
    aborts what has not finished.
    """

    def __init__(
        self, engine: AsyncEngine, prompts: Sequence[list[int]], params: SamplingParams, n: int,
        cls: PriorityClass, timeouts: Timeouts, id_prefix: str, record: RequestRecord | None = None,
    ) -> None:
        self.engine = engine
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
        if self.record is not None:
            self.record.priority_class = self.cls.name
            self.record.prompt_tokens = self.prompt_tokens
        for prompt in self.prompts:  # all checked before any runs
            self.engine.engine.check_request(prompt, self.params, self.n, self.cls)
        try:
            self.engine.admit(self.cls, self.prompts, self.timeouts)
        except AdmissionError as e:
            raise admission_error(e) from None
        try:
            for prompt in self.prompts:
                self.streams.append(self.engine.submit(prompt, self.params, self.n, priority_class=self.cls,
                                                       timeouts=self.timeouts, admitted=True))
        except BaseException:
            self.engine.release(self.cls, self.prompts[len(self.streams):])
            self.abort()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()
        if self.record is not None:
            self.record.completion_tokens = self.completion_tokens

    def _note(self, out: RequestOutput) -> None:
        """A finished choice's outcome and timings, for the request's log line."""
        record, metrics = self.record, out.metrics
        if record is None or not out.finished:
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

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

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
                    if out.finish_reason == "abort":
                        raise engine_abort_error(out)
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

    async def stream(
        self,
        request: web.Request,
        head: list[dict[str, Any]],
        render: Callable[[int, RequestOutput], dict[str, Any] | str],
        tail: Callable[[], list[dict[str, Any]]],
    ) -> web.StreamResponse:
        """Answer with SSE: the `head` events, one `render(prompt, output)` event per output
        (one per token, even when the detokenizer holds its text back), the `tail()` events,
        then `data: [DONE]`. An engine abort (shutdown) ends the stream with an error event."""
        keepalive = request.app[SETTINGS].server.keepalive_seconds
        open_streams = request.app[SSE_RESPONSES]
        events = EventStream()
        open_streams.add(events.response)
        outputs = OutputQueue(self.streams)
        try:
            await events.open(request)
            for payload in head:
                events.add(payload)
            await events.flush()
            while not outputs.done:
                batch = await outputs.next_batch(keepalive)
                if not batch:
                    await events.keepalive()
                    continue
                for prompt, out in batch:
                    self._note(out)
                    if out.finish_reason == "abort":
                        events.add(engine_abort_error(out).body())
                        await events.close()
                        return events.response
                    self.completion_tokens += len(out.new_token_ids)
                    events.add(render(prompt, out))
                    if out.finish_reason == "timeout":  # after the choice's last chunk, say which
                        events.add(timeout_error(out).body())
                await events.flush()
            for payload in tail():
                events.add(payload)
            await events.close()
        except (ConnectionResetError, ClientConnectionResetError):
            log.debug("client of %s left mid-stream", request.path)
        except Exception:  # noqa: BLE001 - the status line is sent: report in the stream, not as a 500
            if not events.response.prepared:
                raise
            log.exception("streaming %s failed", request.path)
            error = APIError(500, "internal server error", type="server_error")
            try:
                events.add(error.body())
                await events.close()
            except (ConnectionResetError, ClientConnectionResetError):
                pass
        finally:
            outputs.close()
            open_streams.discard(events.response)
        return events.response


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


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def engine_abort_error(out: RequestOutput) -> APIError:
    """An abort the engine made (shutdown, engine failure): the request could not finish."""
    reason = out.stop_reason if isinstance(out.stop_reason, str) else "the request was aborted"
    return APIError(503, f"generation stopped: {reason}", code="service_unavailable",
                    headers={"Retry-After": "5"})


def admission_error(e: AdmissionError) -> APIError:
    """A refusal at the door: 429 (queue full, shed, predicted deadline miss) or 503 (draining),
    with when to come back; 400 for a request too large for its class's queue ever to hold."""
    if e.oversized:
        return bad_request(e.message, param="prompt", code="queue_too_small")
    return APIError(e.status, e.message, type="rate_limit_error" if e.status == 429 else None,
                    code=e.reason, headers={"Retry-After": str(e.retry_after)})


TIMEOUT_MESSAGES = {
    "queue": "waited longer than its queue timeout to be scheduled",
    "ttft": "got no first token within its TTFT timeout",
    "token": "waited longer than its per-token timeout for the next token",
    "total": "ran longer than its total timeout",
}


def timeout_error(out: RequestOutput) -> APIError:
    """The error that names which timeout ended a request (an SSE event, or the 503 of a
    non-streaming request that timed out before its first token)."""
    kind = str(out.stop_reason)
    return APIError(503, f"the request {TIMEOUT_MESSAGES.get(kind, 'timed out')}", type="timeout_error",
                    code=f"{kind}_timeout", headers={"Retry-After": "1"})


def clamp_logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def completion_logprobs(
    token_text: TokenTexts, logprobs: list[TokenLogprob], offset: int
) -> dict[str, list[Any]]:
    """OpenAI's completions shape; `offset` is where the first token starts in the choice's text."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for lp in logprobs:
        text = token_text(lp.token_id)[0]
        tokens.append(text)
        token_logprobs.append(clamp_logprob(lp.logprob))
        top_logprobs.append({token_text(t)[0]: clamp_logprob(v) for t, v in lp.top})
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(token_text: TokenTexts, logprobs: list[TokenLogprob]) -> dict[str, list[Any]]:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for lp in logprobs:
        text, raw = token_text(lp.token_id)
        top = []
        for t, v in lp.top:
            top_text, top_raw = token_text(t)
            top.append({"token": top_text, "logprob": clamp_logprob(v), "bytes": top_raw})
        content.append({"token": text, "logprob": clamp_logprob(lp.logprob), "bytes": raw, "top_logprobs": top})
    return {"content": content}


def no_answer() -> web.Response:
    """What a handler returns when its client already left (nobody reads it)."""
    return web.Response(status=499, reason="Client Closed Request")
