"""Server-sent events by hand, and the batching of engine outputs that feeds them.

    engine thread --step--> RequestStream queues --OutputQueue.next_batch()--> [(prompt, output), ...]
                                                         one write() per batch <--'

A step delivers the outputs of every request at once; when the HTTP side falls behind, several
outputs wait in a stream's queue. `next_batch` takes all of them, so the handler writes one
chunk of events per wake-up instead of one per token.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import ClientConnectionResetError, HttpVersion11, web

from inferd.api.streaming.backpressure import client_behind
from inferd.api.errors import APIError
from inferd.engine.async_engine import RequestStream
from inferd.engine.protocol import EngineOutput

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}
# NOTE: one comment line, no blank line after it. A blank line ends an event, and the official
# openai client (3.x) dispatches one there with empty data once an event id has been seen (it
# keeps last_event_id, as the spec says), then fails to parse it: a keep-alive after the first
# token broke its stream. The next event's own blank line ends the comment's line group.
KEEPALIVE = b": keep-alive\n"
DONE = "data: [DONE]\n\n"

log = logging.getLogger(__name__)

SSE_RESPONSES = web.AppKey("sse_responses", set[web.StreamResponse])  # open streams, for shutdown


def dumps(payload: Any) -> str:
    """Compact JSON for the hot path (plain dicts, stdlib json)."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Named:
    """An event with a type line (`event: NAME`): Anthropic's streams name every event; OpenAI's name none."""

    event: str
    data: dict[str, Any]


# one event: a dict, JSON text already (the per-token fast path), or a named one
Payload = dict[str, Any] | str | Named


def frame(id_prefix: str, number: int, payload: Payload) -> str:
    """One event as it goes on the wire, numbered `id: <response id>:<number>`."""
    if isinstance(payload, Named):
        return f"{id_prefix}{number}\nevent: {payload.event}\ndata: {dumps(payload.data)}\n\n"
    data = payload if isinstance(payload, str) else dumps(payload)
    return f"{id_prefix}{number}\ndata: {data}\n\n"


def event_id_prefix(response_id: str) -> str:
    """Every event's `id:` is `<response id>:<sequence number>` (0, 1, ...): what a client sends
    back as Last-Event-ID to resume a resumable stream (resume.py), unique across responses."""
    return f"id: {response_id}:"


class EventSink(Protocol):
    """Where a stream's events go: an `EventStream` (the socket), or a resumable stream's buffer
    (resume.py), which any attached writer copies to its socket."""

    def add(self, payload: Payload) -> None: ...

    async def flush(self) -> None: ...

    async def keepalive(self) -> None: ...


ErrorEvent = Callable[[APIError], Payload]  # an error as its protocol's stream event


@dataclass(frozen=True, slots=True)
class Dialect:
    """What differs between protocols' streams: the error event, and the last line (OpenAI's
    `data: [DONE]`; Anthropic's streams end after their own message_stop event)."""

    error_event: ErrorEvent = APIError.body
    end: str = DONE


class EventStream:
    """An SSE response: numbered `data:` events, buffered until `flush()` writes them at once."""

    def __init__(self, response_id: str, guard: Guard | None = None, end: str = DONE) -> None:
        self._end = end
        self.response = web.StreamResponse(headers=SSE_HEADERS)
        self._id_prefix = event_id_prefix(response_id)
        self._next_id = 0
        self._pending: list[str] = []
        self._guard = guard  # awaited before a write while the client is behind (backpressure.py)
        self._request: web.Request | None = None

    async def open(self, request: web.Request) -> None:
        self._request = request
        delimit_body(request, self.response)
        await self.response.prepare(request)

    def add(self, payload: Payload) -> None:
        """One event."""
        self._pending.append(frame(self._id_prefix, self._next_id, payload))
        self._next_id += 1

    async def flush(self) -> None:
        """Write what was added in one write(); raises ConnectionResetError if the client left."""
        if self._pending:
            data = "".join(self._pending).encode()
            self._pending.clear()
            await self._before_write()
            await self.response.write(data)

    async def keepalive(self) -> None:
        await self._before_write()
        await self.response.write(KEEPALIVE)

    async def _before_write(self) -> None:
        if self._guard is not None and self._request is not None and client_behind(self._request):
            await self._guard()

    async def close(self) -> None:
        """Flush, then the dialect's last line (`data: [DONE]`) and the end of the body."""
        if self._end:
            self._pending.append(self._end)
        await self.flush()
        await self.response.write_eof()


def delimit_body(request: web.Request, response: web.StreamResponse) -> None:
    """A stream's body of unknown length: chunked for HTTP/1.1; an HTTP/1.0 client (nginx's
    default to its upstreams) has no chunked encoding, so its body ends where the connection does."""
    if request.version >= HttpVersion11:
        response.enable_chunked_encoding()
    else:
        response.force_close()


Produce = Callable[[EventSink], Awaitable[None]]  # adds a whole response's events to a sink
Guard = Callable[[], Awaitable[None]]  # waits for a slow client (or cuts it: backpressure.py)


async def write_events(request: web.Request, response_id: str, produce: Produce,
                       open_streams: set[web.StreamResponse], guard: Guard | None = None,
                       dialect: Dialect = Dialect()) -> web.StreamResponse:
    """A stream straight to the socket: what `produce` adds, written as it flushes, then [DONE].
    A disconnect just ends it (the caller aborts the request); a failure once the status line
    is out ends it with an error event instead of a 500. `open_streams` holds it while open;
    `guard` runs before a write that would wait for a client that does not read."""
    events = EventStream(response_id, guard, dialect.end)
    open_streams.add(events.response)
    try:
        await events.open(request)
        await produce(events)
        await events.close()
    except (ConnectionResetError, ClientConnectionResetError):
        log.debug("client of %s left mid-stream", request.path)
    except Exception:  # noqa: BLE001 - the status line is sent: report in the stream, not as a 500
        if not events.response.prepared:
            raise
        log.exception("streaming %s failed", request.path)
        try:
            events.add(dialect.error_event(APIError(500, "internal server error", type="server_error")))
            await events.close()
        except (ConnectionResetError, ClientConnectionResetError):
            pass
    finally:
        open_streams.discard(events.response)
    return events.response


class OutputQueue:
    """The outputs of one HTTP request's engine requests (one per prompt), in batches.

    `done` once the final output of every choice has been taken (each stream, the one tracker
    of its choices, delivers exactly one final output per choice).
    """

    def __init__(self, streams: Sequence[RequestStream]) -> None:
        self._streams = list(streams)
        self._unfinished = sum(s.n for s in self._streams)  # final outputs not taken yet
        self._merged: asyncio.Queue[tuple[int, EngineOutput]] | None = None
        self._forwarders: list[asyncio.Task[None]] = []
        if len(self._streams) > 1:
            # NOTE: one forwarding task per prompt; the single-prompt case reads its stream directly
            self._merged = asyncio.Queue()
            self._forwarders = [asyncio.ensure_future(self._forward(p, s)) for p, s in enumerate(streams)]

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    async def _forward(self, prompt: int, stream: RequestStream) -> None:
        assert self._merged is not None
        while True:
            self._merged.put_nowait((prompt, await stream.get()))

    async def next_batch(self, timeout: float | None) -> list[tuple[int, EngineOutput]]:
        """Wait for at least one output and take everything queued; [] after `timeout` seconds
        without any (time for a keep-alive)."""
        batch: list[tuple[int, EngineOutput]] = []
        if self._merged is None:  # the common case, kept cheap: it runs per token per stream
            for out in await self._streams[0].get_batch(timeout):
                self._take(batch, 0, out)
            return batch
        try:
            async with asyncio.timeout(timeout):
                self._take(batch, *await self._merged.get())
                while not self._merged.empty():
                    self._take(batch, *self._merged.get_nowait())
        except TimeoutError:
            pass
        return batch

    def _take(self, batch: list[tuple[int, EngineOutput]], prompt: int, out: EngineOutput) -> None:
        self._unfinished -= out.finished
        batch.append((prompt, out))

    def close(self) -> None:
        for task in self._forwarders:
            task.cancel()
