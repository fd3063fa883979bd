"""Stored responses over HTTP: keeping them, background ones, and their endpoints.

    POST /v1/responses {"store": true}           create.py: kept once finished (`Keeper.finished`)
    POST /v1/responses {"background": true}      kept from the start; its events go into an
                                                 EventLog (streaming/resume.py) as it generates
    GET    /v1/responses/{id}                    the response (a running one as it stands)
    GET    /v1/responses/{id}?stream=true&starting_after=N
                                                 a background response's events after N, then
                                                 the live ones
    DELETE /v1/responses/{id}                    forgotten (a running one cancelled)
    POST   /v1/responses/{id}/cancel             a running background response stopped, its
                                                 status "cancelled" (again: the same answer)

Each caller sees its own store only (`caller_of`: its tenant, else its key); another's response,
an unknown, expired or evicted one is the same 404. The store itself (store.py) is pure; this
module holds it in the app, sweeps it every second, and counts it in /metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferd.api.errors import RETRY_AFTER_SECONDS, APIError, bad_request
from inferd.api.responses.events import ResponseEvents
from inferd.api.responses.store import EVICTION_REASONS, ResponseStore, Stored
from inferd.api.streaming.resume import EventLog, caller_of, event_number

RESPONSE_STORE = web.AppKey("response_store", ResponseStore)


def store_full(store: ResponseStore) -> APIError:
    return APIError(429, f"{store.max_count} background responses of yours are running already "
                    "(responses.max_per_tenant); retry later", type="rate_limit_error", code="store_full",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no stored response {response_id!r} (unknown, expired, evicted or deleted)", param=param,
                    code="response_not_found")


class Background:
    """A background response's live part (store.py's `Live`): its events, kept whole, and the
    generation producing them; it settles its store entry when the generation ends."""

    def __init__(self, log: EventLog, events: ResponseEvents, entry: Stored, store: ResponseStore,
                 conversation: Callable[[], list[dict[str, Any]]]) -> None:
        self.log, self.events, self.entry, self.store = log, events, entry, store
        self._conversation = conversation  # the conversation as it stands (for a continuation)
        assert log.producer is not None
        log.producer.add_done_callback(lambda _: self._settle("failed"))

    @property
    def bytes(self) -> int:
        return self.log.bytes

    @property
    def running(self) -> bool:
        return not self.log.ended

    def snapshot(self) -> dict[str, Any]:
        return self.events.snapshot("in_progress" if self.events.started else "queued")

    def stop(self, reason: str) -> None:
        """Cancel it (its request aborted): its events end with an error event, its status is
        "cancelled"."""
        if not self.running:
            return
        self.log.stop(self.events.error(APIError(400, reason, code="response_cancelled")))
        self._settle("cancelled")

    def _settle(self, status: str) -> None:
        """The response as it ended without its last event (cancelled, or failed: an engine abort)."""
        if self.entry.response is not None:  # (completed or incomplete: create.py finished it)
            return
        response = self.events.snapshot(status)
        failure = self.events.failure
        if status == "failed" and failure is not None:
            response["error"] = {"code": failure.code or failure.type, "message": failure.message}
        self.entry.finish(response, self._conversation())
        if self.store.holds(self.entry):  # (its neighbours make room)
            self.store.fit(self.entry.owner)


class Keeper:
    """Where one request's response goes when it is kept: its caller's store."""

    def __init__(self, request: web.Request, store: ResponseStore, owner: str) -> None:
        self.request, self.store, self.owner = request, store, owner
        self.entry: Stored | None = None  # a background response's, held from its start

    def finished(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """The response ended (completed or incomplete): keep it, within the bounds."""
        if self.entry is None:
            entry = Stored(response_id, self.owner)
            entry.finish(response, conversation)
            self.store.put(entry)
        else:  # a background response, held from its start
            self.entry.finish(response, conversation)
            if self.store.holds(self.entry):  # (not deleted or evicted meanwhile)
                self.store.fit(self.owner)

    async def background(self, log: EventLog, events: ResponseEvents, stream: bool,
                         conversation: Callable[[], list[dict[str, Any]]]) -> web.StreamResponse:
        """Hold a background response from its start; answer at once with it as it stands (or,
        with `stream`, follow its events: a disconnect leaves it running)."""
        if not self.store.has_room(self.owner):  # (others started since create.py's check)
            log.stop()  # (its generation ends: the request aborted, the charge refunded)
            raise store_full(self.store)
        self.entry = Stored(log.id, self.owner)
        self.entry.live = Background(log, events, self.entry, self.store, conversation)
        self.store.put(self.entry)
        if stream:
            return await log.serve(self.request, -1)
        return web.json_response(self.entry.live.snapshot())


def _find(request: web.Request) -> Stored:
    response_id = request.match_info["response_id"]
    entry = request.app[RESPONSE_STORE].get(caller_of(request), response_id)
    if entry is None:
        raise not_found(response_id)
    return entry


def _current(entry: Stored) -> dict[str, Any]:
    if entry.response is not None:
        return entry.response
    assert isinstance(entry.live, Background)
    return entry.live.snapshot()


async def retrieve(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{response_id}: the response; with ?stream=true a background one's events
    after ?starting_after=N (default: from the first), then the live ones."""
    entry = _find(request)
    stream = request.query.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise bad_request(f"stream must be true or false, got {stream!r}", param="stream")
    if stream == "false":
        return web.json_response(_current(entry))
    if not isinstance(entry.live, Background):
        raise bad_request("only a background response's events are kept: retrieve it without stream",
                          param="stream")
    log = entry.live.log
    after = request.query.get("starting_after")
    return await log.serve(request, -1 if after is None else event_number(after, "starting_after", log))


async def delete(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{response_id}: forgotten; a running background one is cancelled."""
    entry = _find(request)
    request.app[RESPONSE_STORE].delete(entry.owner, entry.id)
    if entry.live is not None:
        entry.live.stop("the response was deleted")
    return web.json_response({"id": entry.id, "object": "response.deleted", "deleted": True})


async def cancel(request: web.Request) -> web.Response:
    """POST /v1/responses/{response_id}/cancel: a running background response stopped (its KV
    blocks freed at the engine's next step); an ended one answered as it is."""
    entry = _find(request)
    if entry.live is None:
        raise bad_request("only a background response can be cancelled", param="response_id",
                          code="not_background")
    entry.live.stop("the response was cancelled")
    return web.json_response(_current(entry))


def add_stored_endpoints(app: web.Application) -> None:
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)


async def sweep_forever(store: ResponseStore) -> None:
    """Evict what expired, every second (or twice a time to live): none is held much past it."""
    every = max(0.05, min(1.0, store.ttl / 2))
    while True:
        await asyncio.sleep(every)
        store.sweep()


class StoreCollector(Collector):
    """/metrics: the store's evictions by why, and what it holds (every tenant's)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        store = self.store
        store.sweep()  # (what has expired is evicted, and counted, before it is shown)
        evicted = CounterMetricFamily("inferd_responses_evicted", "Stored responses evicted, by why: ttl "
                                      "(responses.ttl_seconds ran out) or capacity (their tenant's store was over "
                                      "responses.max_per_tenant or max_bytes_per_tenant).", labels=["reason"])
        for reason in EVICTION_REASONS:
            evicted.add_metric([reason], store.evictions[reason])
        yield evicted
        yield GaugeMetricFamily("inferd_responses_stored", "Responses held in the store.", value=store.held)
        yield GaugeMetricFamily("inferd_responses_stored_bytes", "Their JSON text and events, all told.",
                                value=store.size())
