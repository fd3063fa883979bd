"""The aiohttp application: keys, middlewares, routes and the models' lifecycle.

    startup   cleanup_ctx: models.start(): each model's (its engine thread runs; /ready turns 200
              engine, its inference probe in a task;    once every model's probe has run)
              the degradation triggers' clock; the
              event loop's lag timer; the response
              store's sweeper; the idle models' watcher
              (routing/lifecycle.py: unloads)
    shutdown  on_shutdown: models.stop(), then wait     (every open stream ends with an abort:
              for the open SSE responses to end          handlers write an error event and [DONE])
    cleanup   cleanup_ctx: models.stop()                (a no-op by then; the same path on a
                                                         failed startup)

aiohttp runs on_shutdown before it waits for handlers, so streams end at once instead of
holding the shutdown until their last token. `inferd serve` drains first (server.py): by the
time shutdown starts, only the requests its grace period cut off are still open.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from inferd.api.edge import EDGE, MAX_BODY_BYTES, EdgeCounts, edge_middleware
from inferd.api.endpoints import add_endpoints
from inferd.api.errors import error_middleware
from inferd.api.gateway.gate import GATEWAY, Gateway
from inferd.api.gateway.keys import auth_middleware, principal_of
from inferd.api.gateway.tenants import Keyring
from inferd.api.kv_events import KVEventPublisher, KVEventsCollector, publishing
from inferd.api.offload import OFFLOAD, Offload
from inferd.api.conversation.tool_policy import DROPPED_TOOLS
from inferd.api.conversation.volatile import VOLATILE, VolatileBlocks
from inferd.api.pipeline.generate import ANSWERED_BY, FALLBACK_FROM, MAX_TOKENS_CLAMPED
from inferd.api.pipeline.sessions import SESSION_ECHO, SESSION_HEADER
from inferd.api.record import RECORD, REQUEST_ID_HEADER, request_id
from inferd.api.responses.store import ResponseStore
from inferd.api.responses.stored import RESPONSE_STORE, StoreCollector, sweep_forever
from inferd.api.routing.holds import hold_middleware
from inferd.api.routing.lifecycle import watch_idle
from inferd.api.routing.registry import REGISTRY, ModelRegistry
from inferd.api.state import SETTINGS, STATE
from inferd.api.streaming.backpressure import SLOW_CLIENTS, SlowClientCounts
from inferd.api.streaming.resume import RESUMABLE, StreamRegistry
from inferd.api.streaming.sse import SSE_RESPONSES
from inferd.api.telemetry.access_log import access_log_middleware
from inferd.api.telemetry.loop_lag import LOOP_LAG, LoopLag
from inferd.api.telemetry.metrics import COLLECTORS, setup_metrics
from inferd.api.telemetry.request_file import setup_request_file
from inferd.settings.config import Settings

log = logging.getLogger(__name__)

STREAMS_END_SECONDS = 5.0  # how long shutdown waits for open streams to write their last event


def create_app(registry: ModelRegistry, settings: Settings, api_keys: frozenset[str] = frozenset(),
               reload_keys: Callable[[], Keyring] | None = None) -> web.Application:
    """The app over a registry of the served models (routing/registry.py; one engine alone:
    `single_model`): tenants and admin keys from `settings`, plain keys as `api_keys` (hex
    digests); `reload_keys` re-reads them all (SIGHUP, POST /admin/reload)."""
    primary = registry.primary.current  # (None: the first model loads on demand; its policy is the settings')
    policy = primary.engine.limits.policy if primary is not None else settings.policy()
    gateway = Gateway(Keyring.build(settings, api_keys), policy, reload_keys)
    server = settings.server
    # outermost first: the access log sees the final status, which the error middleware renders
    middlewares = [access_log_middleware, error_middleware, edge_middleware(MAX_BODY_BYTES),
                   auth_middleware(lambda: gateway.keyring, server.open_paths, server.status_admin_only),
                   hold_middleware]  # (innermost: a request's holds on its models end as its handler returns)
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[REGISTRY] = registry
    app[GATEWAY] = gateway
    app[SETTINGS] = settings
    app[STATE] = registry.server
    app[SSE_RESPONSES] = set()
    app[SLOW_CLIENTS] = SlowClientCounts()
    app[EDGE] = EdgeCounts()
    app[OFFLOAD] = Offload()
    app[VOLATILE] = VolatileBlocks(settings.cache.volatile_prompt_patterns)  # (a bad pattern: SettingsError)
    app[LOOP_LAG] = LoopLag()
    app[RESUMABLE] = StreamRegistry(server.resume_grace_seconds, server.resume_max_streams, server.keepalive_seconds,
                                    app[SSE_RESPONSES])
    stored = settings.responses
    app[RESPONSE_STORE] = ResponseStore(stored.max_per_tenant, stored.max_bytes_per_tenant, stored.ttl_seconds)
    add_endpoints(app)
    setup_request_file(app, settings.request_log, app[STATE].model_name)  # before the metrics, which read it
    setup_metrics(app)
    app[COLLECTORS].register(StoreCollector(app[RESPONSE_STORE]))  # (the Responses API's store: its own module)
    app.on_response_prepare.append(_rate_limit_headers)
    app.on_response_prepare.append(_model_headers)
    if settings.kv_events.enabled:  # (cache-aware routers' feed: bound before the models start, closed after)
        registry.kv_events = publisher = KVEventPublisher(settings.kv_events)
        app[COLLECTORS].register(KVEventsCollector(publisher))
        app.cleanup_ctx.append(publishing(publisher))
    app.cleanup_ctx.append(_models_lifecycle)
    app.on_shutdown.append(_end_streams)
    return app


async def _rate_limit_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every response to a tenant carries its x-ratelimit-* headers, as its buckets stand when
    the headers go out (after the refund, for a whole reply)."""
    principal = principal_of(request)
    if principal.tenant is not None:
        response.headers.update(request.app[GATEWAY].headers(principal))


async def _model_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Which model and revision answered (x-inferd-model: "name@revision"), when a degraded
    model's fallback did, the model asked for (x-inferd-fallback-from), the max_tokens a
    clamped request ran with (x-inferd-max-tokens-clamped), and the tool types left out
    (x-inferd-dropped-tools). For a router's session affinity (docs/fleet.md): the request's id
    (x-request-id: the client's own, else inferd's) and the session key the client named
    (x-session-id), echoed only where fit for a header (record.echoable), never made up."""
    rid = request_id(request.get(RECORD))
    if rid is not None:
        response.headers[REQUEST_ID_HEADER] = rid
    session = request.get(SESSION_ECHO)
    if session is not None:
        response.headers[SESSION_HEADER] = session
    answered_by = request.get(ANSWERED_BY)
    if answered_by is not None:
        response.headers["x-inferd-model"] = answered_by
    fallback_from = request.get(FALLBACK_FROM)
    if fallback_from is not None:
        response.headers["x-inferd-fallback-from"] = fallback_from
    dropped = request.get(DROPPED_TOOLS)
    if dropped is not None:
        response.headers["x-inferd-dropped-tools"] = dropped
    clamped = request.get(MAX_TOKENS_CLAMPED)
    if clamped is not None:
        response.headers["x-inferd-max-tokens-clamped"] = str(clamped)


async def _models_lifecycle(app: web.Application) -> AsyncIterator[None]:
    registry = app[REGISTRY]
    await registry.start()  # (each model's engine thread and probe)
    tasks = [asyncio.ensure_future(_ready_when_probed(registry)), asyncio.ensure_future(registry.watch()),
             asyncio.ensure_future(app[LOOP_LAG].watch()),
             asyncio.ensure_future(sweep_forever(app[RESPONSE_STORE])), asyncio.ensure_future(watch_idle(registry))]
    yield
    for task in tasks:
        task.cancel()
    await registry.stop()


async def _ready_when_probed(registry: ModelRegistry) -> None:
    while not registry.probed:
        await asyncio.sleep(0.02)
    registry.server.probed = True


async def _end_streams(app: web.Application) -> None:
    open_streams = app[SSE_RESPONSES]
    if open_streams:
        log.info("shutting down: ending %d open streams", len(open_streams))
    app[STATE].draining = True  # every door: new requests get 503 with a Retry-After
    await app[REGISTRY].stop()  # every unfinished request gets an abort output
    deadline = time.monotonic() + STREAMS_END_SECONDS
    while open_streams and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if open_streams:
        log.warning("%d streams did not end within %.0f s", len(open_streams), STREAMS_END_SECONDS)
    app[RESUMABLE].close()  # (detached resumable streams: their requests ended with the engine)
    app[RESPONSE_STORE].close()  # (background responses' requests too; nothing stored outlives the server)
