"""Resumable streams: a stream that outlives its client's disconnect, and /v1/streams/<id>.

`EventLog` is the ring under them: a response's events kept whole as a task of their own
produces them, replayed from any sequence number and followed live by its writers. A resumable
stream (`ResumableStream`) is one with a single writer and a grace period; a background
response of the Responses API (api/responses/background.py) is one nobody is attached to at
first, which the response store keeps.

    POST ... {"stream": true, "resumable": true}
        producer task:  engine outputs --render--> ResumableStream.events   (every event kept)
        writer:         the POST's handler, then after a disconnect GET /v1/streams/<id> with
                        Last-Event-ID (or ?after=N): events[N+1:], then each new one, then [DONE]
    DELETE /v1/streams/<id>: the request aborted at once, its events dropped

A plain stream's disconnect still means "stop, free the KV cache now" (generation.py); a resumable
one's means "go on for server.resume_grace_seconds": the request keeps generating, its events
kept, and a writer attaching within the grace cancels the timer (a new writer also replaces
one still attached: the client knows better than the server that it left). When the grace ends
with nobody attached, the producer is cancelled, which ends the `Generation` (its request
aborted: its KV blocks return at the engine's next step) and the events are dropped. A request
that finishes while detached keeps its events until the grace ends, so a late resume still gets
the end; one whose writer sent [DONE] is dropped at once.

Bounds. One stream holds at most `event_bound()` events: its head, max_tokens + 2 per choice
(an event per output and an output per token, a timeout's error, a token-less final output), a
tail and an ending error; each ~150-300 bytes (more with logprobs). So limits.max_tokens_limit,
max_n and max_prompts bound a stream, and server.resume_max_streams bounds how many are held at
once (attached or not, running or finished within their grace): a request for one more gets a
429 with a Retry-After. At the defaults, 1024 streams of 256 tokens hold ~50 MB.

Who may resume or cancel: the caller that started it (`caller_of`): its tenant (any of the
tenant's keys), else its very key; on an open server, anyone. Anybody else gets the same 404 as
an unknown id, so the answer never confirms that an id exists; ids are `cmpl-`/`chatcmpl-` +
a uuid4 (122 random bits), not guessable.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from collections.abc import Callable

from aiohttp import ClientConnectionResetError, web

from inferd.api.gateway.keys import KEY_DIGEST, principal_of
from inferd.api.errors import RETRY_AFTER_SECONDS, APIError, bad_request
from inferd.api.streaming.sse import KEEPALIVE, SSE_HEADERS, Dialect, Payload, Produce, delimit_body, event_id_prefix, frame

log = logging.getLogger(__name__)

_INT = re.compile(r"-?[0-9]{1,18}")


def event_bound(head: int, choices: int, max_tokens: int, per_token: int = 1) -> int:
    """The most events one response can have (see the module's docstring), when one output token
    makes at most `per_token` events (one in OpenAI's chat and completions streams)."""
    return head + choices * (max_tokens + 2) * per_token + 2


def caller_of(request: web.Request) -> str:
    """Who may resume or cancel the streams this request starts: its tenant, else its very key
    (the digest the auth middleware keeps); on an open server (no key), anyone."""
    principal = principal_of(request)
    if principal.tenant is not None:
        return f"tenant:{principal.tenant.name}"
    key = request.get(KEY_DIGEST)
    return "anyone" if key is None else f"key:{key}"


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no resumable stream {response_id!r} (unknown, ended, or its grace period is over)",
                    code="stream_not_found")


class EventLog:
    """One response's events, produced by a task of their own into a list kept whole, and the
    writers that copy them to their sockets (event loop only). Also the producer's `EventSink`:
    `add` keeps an event, `flush` wakes the writers. Any number of writers may follow it; a
    resumable stream admits one at a time (ResumableStream), a background response any
    (api/responses/)."""

    def __init__(self, response_id: str, bound: int, open_streams: set[web.StreamResponse], keepalive: float,
                 dialect: Dialect = Dialect()) -> None:
        self.id = response_id
        self.bound = bound
        self.open_streams = open_streams  # every open SSE response, for shutdown (app.py)
        self.keepalive_seconds = keepalive  # between a waiting writer's keep-alive comments
        self.dialect = dialect  # an error event's shape, and the stream's last line
        self.events: list[str] = []  # event i has sequence number i: its whole SSE text
        self.bytes = 0  # the events' text, all told (what a store of them accounts)
        self._id_prefix = event_id_prefix(response_id)
        self.ended = False  # the producer is done: no event follows
        self.producer: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()  # new events, the end, or another writer

    # ------------------------------------------------------------------- the producer's side

    def add(self, payload: Payload) -> None:
        if len(self.events) >= self.bound:  # NOTE: cannot happen (see event_bound); never grow past it
            raise OverflowError(f"the events of {self.id} would be more than {self.bound}")
        self.append(payload)

    def append(self, payload: Payload) -> None:
        """One more event, past the bound too (the one that ends a cancelled or failed response)."""
        text = frame(self._id_prefix, len(self.events), payload)
        self.events.append(text)
        self.bytes += len(text)

    async def flush(self) -> None:
        self._changed.set()

    async def keepalive(self) -> None:
        pass  # (a waiting writer sends its own)

    def start(self, produce: Produce, on_end: Callable[[], None]) -> None:
        """Run `produce` in a task of its own; `on_end` once it is over, however it ends (even
        cancelled before it ran): it aborts what is unfinished and closes the accounts."""
        self.producer = asyncio.ensure_future(self._produce(produce))
        self.producer.add_done_callback(lambda _: self._ended(on_end))

    async def _produce(self, produce: Produce) -> None:
        try:
            await produce(self)
        except Exception:  # noqa: BLE001 - a bug ends this stream with an error event, as sse.py's do
            log.exception("producing the events of %s failed", self.id)
            self.append(self.dialect.error_event(APIError(500, "internal server error", type="server_error")))

    def _ended(self, on_end: Callable[[], None]) -> None:
        self.ended = True
        self._changed.set()
        on_end()

    def stop(self, last: Payload | None = None) -> bool:
        """Cancel the producer if it still runs (its request aborted: the KV blocks return at the
        engine's next step), `last` its final event; whether it was still running."""
        if self.producer is None or self.producer.done():
            return False
        if last is not None:
            self.append(last)
        self.producer.cancel()
        return True

    # --------------------------------------------------------------------- the writer's side

    async def serve(self, request: web.Request, after: int) -> web.StreamResponse:
        """Attach as a writer: every event after sequence number `after`, then each new one,
        then the dialect's end; until then, a disconnect, or (`_writing`) a newer writer."""
        token = object()
        self._attach(token)
        response = web.StreamResponse(headers=SSE_HEADERS)
        sent = after + 1
        self.open_streams.add(response)
        try:
            delimit_body(request, response)
            await response.prepare(request)
            while self._writing(token):
                self._changed.clear()
                if sent < len(self.events):
                    data, sent = "".join(self.events[sent:]), len(self.events)
                    await response.write(data.encode())
                elif self.ended:
                    if self.dialect.end:
                        await response.write(self.dialect.end.encode())
                    await response.write_eof()
                    self._delivered()
                    break
                elif not await _changed(self._changed, self.keepalive_seconds):
                    await response.write(KEEPALIVE)
        except (ConnectionResetError, ClientConnectionResetError):
            log.debug("a client of the events of %s left", self.id)
        finally:
            self.open_streams.discard(response)
            self._detach(token)
        return response

    def _attach(self, token: object) -> None:
        pass

    def _writing(self, token: object) -> bool:
        return True

    def _delivered(self) -> None:
        pass

    def _detach(self, token: object) -> None:
        pass


class ResumableStream(EventLog):
    """One resumable response: an EventLog with at most one writer, whose disconnect starts the
    grace period (the module's docstring)."""

    def __init__(self, registry: StreamRegistry, response_id: str, caller: str, bound: int) -> None:
        super().__init__(response_id, bound, registry.open_streams, registry.keepalive)
        self.registry = registry
        self.caller = caller
        self.delivered = False  # a writer sent every event and [DONE]
        self.writer: object | None = None  # the attached writer's token
        self._grace: asyncio.TimerHandle | None = None

    def _attach(self, token: object) -> None:
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self.writer = token  # (a writer still attached sees it is replaced, and ends)
        self._changed.set()

    def _writing(self, token: object) -> bool:
        return self.writer is token

    def _delivered(self) -> None:
        self.delivered = True

    def _detach(self, token: object) -> None:
        if self.writer is not token:
            return  # replaced by a newer writer
        self.writer = None
        if self.delivered:
            self.registry.drop(self)
        elif self.registry.holds(self):  # (not once cancelled)
            self._grace = asyncio.get_running_loop().call_later(self.registry.grace, self._expire)

    def _expire(self) -> None:
        """The grace period ended with nobody attached: abort the request, drop the events."""
        self._grace = None
        log.info("resumable stream %s: nobody came back within %.0f s; dropped", self.id, self.registry.grace)
        self.cancel(None)

    def cancel(self, reason: str | None = "the stream was cancelled (DELETE)") -> None:
        """Abort the request now (its KV blocks return at the engine's next step) and forget the
        stream; an attached writer sends `reason` as an error event, then [DONE]."""
        self.registry.drop(self)
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self.stop(None if reason is None else APIError(499, reason, code="stream_cancelled").body())


async def _changed(event: asyncio.Event, timeout: float) -> bool:
    """Whether `event` was set within `timeout` seconds."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True


class StreamRegistry:
    """Response id -> the `ResumableStream`s held now, and the handlers of /v1/streams/<id>."""

    def __init__(self, grace: float, max_streams: int, keepalive: float,
                 open_streams: set[web.StreamResponse]) -> None:
        self.grace = grace  # seconds a detached stream waits for its client
        self.max_streams = max_streams
        self.keepalive = keepalive  # seconds between a waiting writer's keep-alive comments
        self.open_streams = open_streams  # every open SSE response, for shutdown (app.py)
        self._streams: dict[str, ResumableStream] = {}

    @property
    def held(self) -> int:
        return len(self._streams)

    @property
    def detached(self) -> int:
        """Streams no client is attached to (running on, or finished, within their grace)."""
        return sum(1 for s in self._streams.values() if s.writer is None)

    def check_room(self) -> None:
        """429 if no other resumable stream may be held now."""
        if len(self._streams) >= self.max_streams:
            raise APIError(429, f"{self.max_streams} resumable streams are held already (server.resume_max_streams); "
                           "retry later, or stream without resumable", type="rate_limit_error",
                           code="too_many_resumable_streams", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def open(self, response_id: str, caller: str, bound: int, produce: Produce,
             on_end: Callable[[], None]) -> ResumableStream:
        """Hold a new stream and start its producer (429 when full)."""
        self.check_room()
        stream = ResumableStream(self, response_id, caller, bound)
        self._streams[response_id] = stream
        stream.start(produce, on_end)
        return stream

    def holds(self, stream: ResumableStream) -> bool:
        return self._streams.get(stream.id) is stream

    def drop(self, stream: ResumableStream) -> None:
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]

    def close(self) -> None:
        """Shutdown: every stream forgotten, its request aborted if it still runs."""
        for stream in list(self._streams.values()):
            stream.cancel("the server is shutting down")

    def _find(self, request: web.Request) -> ResumableStream:
        response_id = request.match_info["response_id"]
        stream = self._streams.get(response_id)
        if stream is None or not hmac.compare_digest(stream.caller, caller_of(request)):
            raise _not_found(response_id)  # (another caller's stream: the same answer)
        return stream

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/streams/{response_id}: the events after Last-Event-ID (or ?after=N; neither:
        from the start), then live, as the POST would have streamed them."""
        stream = self._find(request)
        return await stream.serve(request, resume_point(request, stream))

    async def delete(self, request: web.Request) -> web.Response:
        """DELETE /v1/streams/{response_id}: abort the request now, forget its events."""
        stream = self._find(request)
        stream.cancel()
        return web.json_response({"id": stream.id, "object": "stream", "deleted": True})


RESUMABLE = web.AppKey("resumable", StreamRegistry)  # resumable streams by response id


def resume_point(request: web.Request, stream: ResumableStream) -> int:
    """The sequence number of the last event the client has: ?after=N, else Last-Event-ID
    (`<response id>:N`, or N), else -1 (from the start); a 400 unless the stream has it."""
    value, param = request.query.get("after"), "after"
    if value is None:
        value, param = request.headers.get("Last-Event-ID"), "Last-Event-ID"
        if value is None:
            return -1
        owner, colon, value = value.strip().rpartition(":")
        if colon and owner != stream.id:
            raise bad_request(f"Last-Event-ID {owner}:... names another response than {stream.id}", param=param)
    return event_number(value, param, stream)


def event_number(value: str, param: str, events: EventLog) -> int:
    """`value` as the sequence number of one of `events` so far, or -1 (before the first); else a
    400 naming `param`."""
    if not _INT.fullmatch(value.strip()):
        raise bad_request(f"{param} must be an event's sequence number, got {value!r}", param=param)
    after = int(value)
    if not -1 <= after < len(events.events):
        raise bad_request(f"{param} must be in [-1, {len(events.events) - 1}] (the events so far), got {after}",
                          param=param)
    return after
