"""One HTTP request's engine requests, from admission to their end: gathered into one reply or
streamed as SSE events (the pipeline decides which model and how; this runs it).

Every engine request a handler submits lives inside `Generation`'s `with` block, whose exit
aborts whatever is still running: a finished request ignores the abort, a disconnected or
cancelled client's request gives its KV blocks back at the engine's next step.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from inferd.api.admission.ask import Prepared
from inferd.api.admission.door import FrontDoor
from inferd.api.errors import APIError, engine_abort_error, engine_failure_error, timeout_error
from inferd.api.gateway.gate import Ticket
from inferd.api.record import RequestRecord
from inferd.api.state import SETTINGS
from inferd.api.streaming.backpressure import SLOW_CLIENTS, bound_send_buffer, wait_for_reader
from inferd.api.streaming.resume import RESUMABLE, EventLog, caller_of, event_bound
from inferd.api.streaming.sse import (
    SSE_RESPONSES,
    Dialect,
    ErrorEvent,
    EventSink,
    OutputQueue,
    Payload,
    Produce,
    write_events,
)
from inferd.engine.async_engine import RequestStream
from inferd.engine.protocol import EngineOutput, TokenLogprob

POLL_SECONDS = 1.0  # how often a non-streaming handler checks that its client is still there

Render = Callable[[int, EngineOutput], Payload | list[Payload]]  # an output's event(s)


@dataclass
class ChoiceResult:
    """One choice, gathered for a non-streaming reply."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # (what a harmony answer is read from)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id it ended on (finish "stop")
    prompt_logprobs: list[TokenLogprob] | None = None  # (asked for) its prompt's, with choice 0

    @property
    def text(self) -> str:
        return "".join(self.texts)


class Generation:
    """The engine requests of one HTTP request: one per prompt, each with n choices.

    `with Generation(...) as gen:` has the door admit every prompt into its class's queue (or
    none: 429 / 503), then submit them; leaving the block, however it is left, aborts what has
    not finished.
    """

    outlives_handler = False  # a resumable stream: its producer's task ends it, not the `with` block

    def __init__(self, door: FrontDoor, prepared: Prepared, id_prefix: str, record: RequestRecord | None = None,
                 ticket: Ticket | None = None, volatile_blocks: int = 0) -> None:
        self.door = door
        self.prepared = prepared
        self.ticket = ticket  # its tenant's account: refunded and counted at the end
        self.segment = prepared.segment  # "sentence" / "line": the engine holds text back; empty deltas are not sent
        self.prompts = prepared.prompts
        self.n = prepared.n
        self.record = record  # the request's log line, filled in as outputs finish
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"  # the response's id
        if record is not None:
            record.id = self.id
        self.created = int(time.time())
        self.streams: list[RequestStream] = []
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied (each prompt's first choice)
        self.host_cached_tokens = 0  # of which from the host tier
        self.misses: dict[int, str] = {}  # group id -> why its cache served no more (a miss only)
        self.volatile_blocks = volatile_blocks  # prompt blocks its front-end dropped (Ask.volatile_blocks)
        if record is not None and volatile_blocks:
            record.volatile_blocks = volatile_blocks
        self.drafted_tokens = self.accepted_tokens = 0  # speculation's, over every choice

    @property
    def prompt_tokens(self) -> int:
        return self.prepared.prompt_tokens

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage, and inferd's extensions: `prompt_cache` always, `speculative` where
        drafts were verified."""
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}, "prompt_cache": self.prompt_cache()}
        if self.drafted_tokens:
            usage["speculative"] = {"drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens}
        return usage

    @property
    def cache_miss(self) -> str | None:
        """Why the prefix cache served no more: the first prompt's reason that missed (None: every hit)."""
        return self.misses[min(self.misses)] if self.misses else None  # (group ids rise prompt by prompt)

    def prompt_cache(self) -> dict[str, Any]:
        """What the prefix cache served of the prompts, and why no more."""
        cache: dict[str, Any] = {"cached_tokens": self.cached_tokens, "host_tokens": self.host_cached_tokens,
                                 "miss": self.cache_miss}
        if self.volatile_blocks:
            cache["volatile_blocks"] = self.volatile_blocks
        return cache

    def __enter__(self) -> Generation:
        ticket = self.ticket
        if self.record is not None:
            self.record.priority_class = self.prepared.cls.name
            self.record.prompt_tokens = self.prompt_tokens
        try:
            self.streams = self.door.admit(self.prepared)
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

    def note(self, out: EngineOutput) -> None:
        """A finished choice's outcome and timings, for the request's log line and its tenant."""
        record, metrics = self.record, out.metrics
        if record is not None and record.texts is not None:  # every output's text, for the request file
            record.texts.add(out)
        if not out.finished:
            return
        if metrics is not None and out.index == 0:
            self.cached_tokens += metrics.cached_tokens
            self.host_cached_tokens += metrics.host_cached_tokens
            if metrics.cache_miss is not None:
                self.misses[out.group_id] = metrics.cache_miss
        if metrics is not None:
            self.drafted_tokens += metrics.drafted_tokens
            self.accepted_tokens += metrics.accepted_tokens
        if self.ticket is not None and metrics is not None:
            self.ticket.finished(metrics)
        if record is None:
            return
        record.finish.append(out.finish_reason or "-")
        if metrics is None:
            return
        if out.index == 0:
            record.cached_tokens += metrics.cached_tokens
            record.host_cached_tokens += metrics.host_cached_tokens
            record.cache_miss = self.cache_miss
        record.preemptions += metrics.preemptions
        if metrics.drafted_tokens:
            record.drafted_tokens = (record.drafted_tokens or 0) + metrics.drafted_tokens
            record.accepted_tokens = (record.accepted_tokens or 0) + metrics.accepted_tokens
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
                    self.note(out)
                    if out.finish_reason in ("abort", "error"):
                        raise ending_error(out)
                    result = results[prompt * self.n + out.index]
                    if out.finish_reason == "timeout" and not result.texts and not out.text:
                        raise timeout_error(out)  # nothing to show for it: an error, not a reply
                    result.texts.append(out.text)
                    result.token_ids += out.new_token_ids
                    self.completion_tokens += len(out.new_token_ids)
                    if out.logprobs:
                        result.logprobs += out.logprobs
                    if out.prompt_logprobs is not None:
                        result.prompt_logprobs = out.prompt_logprobs
                    if out.finished:
                        result.finish_reason, result.stop_reason = out.finish_reason, out.stop_reason
        finally:
            outputs.close()
        return results

    async def stream(self, request: web.Request, head: list[Payload], render: Render,
                     tail: Callable[[], list[Payload]], resumable: bool = False,
                     dialect: Dialect = Dialect()) -> web.StreamResponse:
        """Answer with SSE: the `head` events, one `render(prompt, output)` event per output
        (one per token, even when the detokenizer holds its text back), the `tail()` events,
        then `data: [DONE]` (the `dialect`'s end). An engine abort (shutdown) ends the stream
        with an error event (in the dialect's shape).
        Written straight to the socket (sse.py); a `resumable` stream's events are produced by a
        task of their own that outlives a disconnect, into a buffer its writers copy (resume.py)."""
        produce = self._producer(request, head, render, tail, dialect)
        if not resumable:
            server = request.app[SETTINGS].server
            bound_send_buffer(request, server.stream_send_buffer_bytes)
            guard = functools.partial(wait_for_reader, request, self.streams, server.slow_client_seconds,
                                      request.app[SLOW_CLIENTS])
            return await write_events(request, self.id, produce, request.app[SSE_RESPONSES], guard, dialect)
        stream = request.app[RESUMABLE].open(self.id, caller_of(request), self._event_bound(len(head)), produce,
                                             self.end)
        self.outlives_handler = True
        return await stream.serve(request, -1)

    def detach(self, request: web.Request, head: list[Payload], render: Render, tail: Callable[[], list[Payload]],
               dialect: Dialect = Dialect(), per_token: int = 1) -> EventLog:
        """Produce the stream's events (as `stream` would) into an EventLog nobody is attached to
        yet, in a task of its own that ends this generation: a background response, which goes on
        after the handler has answered. Whoever holds the log bounds how long it lives; a token
        makes at most `per_token` events."""
        keepalive = request.app[SETTINGS].server.keepalive_seconds
        bound = self._event_bound(len(head), per_token)
        events = EventLog(self.id, bound, request.app[SSE_RESPONSES], keepalive, dialect)
        events.start(self._producer(request, head, render, tail, dialect), self.end)
        self.outlives_handler = True
        return events

    def _event_bound(self, head: int, per_token: int = 1) -> int:
        return event_bound(head, len(self.prompts) * self.n, self.prepared.params.max_tokens, per_token)

    def _producer(self, request: web.Request, head: list[Payload], render: Render, tail: Callable[[], list[Payload]],
                  dialect: Dialect) -> Produce:
        """What adds the stream's events to a sink: the head, every output as it comes, the tail."""
        keepalive = request.app[SETTINGS].server.keepalive_seconds

        async def produce(events: EventSink) -> None:
            outputs = OutputQueue(self.streams)
            try:
                for payload in head:
                    events.add(payload)
                await events.flush()
                if await self._stream_outputs(outputs, events, render, keepalive, dialect.error_event):
                    for payload in tail():
                        events.add(payload)
            finally:
                outputs.close()

        return produce

    async def _stream_outputs(self, outputs: OutputQueue, events: EventSink, render: Render,
                              keepalive: float, error_event: ErrorEvent) -> bool:
        """Write every output as it comes; False if an engine abort or failure cut the stream short."""
        held: dict[tuple[int, int], list[int]] = {}  # (prompt, choice) -> ids of outputs not rendered yet
        while not outputs.done:
            batch = await outputs.next_batch(keepalive)
            if not batch:
                await events.keepalive()
                continue
            for prompt, out in batch:
                self.note(out)
                if out.finish_reason in ("abort", "error"):  # the response ends here
                    events.add(error_event(ending_error(out)))
                    return False
                self.completion_tokens += len(out.new_token_ids)
                if not out.text and self.segment != "token" and not out.finished and not out.logprobs:
                    # segmented: no event for a token whose text is held back; its id goes with the
                    # next one (a harmony answer is read from its ids)
                    held.setdefault((prompt, out.index), []).extend(out.new_token_ids)
                    continue
                if (prompt, out.index) in held:
                    out = dataclasses.replace(out, new_token_ids=held.pop((prompt, out.index)) + out.new_token_ids)
                rendered = render(prompt, out)
                for payload in rendered if isinstance(rendered, list) else (rendered,):
                    events.add(payload)
                if out.finish_reason == "timeout":  # after the choice's last chunk, say which
                    events.add(error_event(timeout_error(out)))
            await events.flush()
        return True


def ending_error(out: EngineOutput) -> APIError:
    """Why a choice ended without an answer: an engine abort (shutdown) or a failure."""
    return engine_abort_error(out) if out.finish_reason == "abort" else engine_failure_error(out)


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def no_answer() -> web.Response:
    """What a handler returns when its client already left (nobody reads it)."""
    return web.Response(status=499, reason="Client Closed Request")
