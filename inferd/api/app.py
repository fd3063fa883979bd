"""The aiohttp application: keys, middlewares, routes and the engine's lifecycle.

    startup   cleanup_ctx: engine.start(), the inference  (the engine thread runs; /ready turns
              probe in a task                            200 once the probe has run)
    shutdown  on_shutdown: engine.stop(), then wait     (every open stream ends with an abort:
              for the open SSE responses to end          handlers write an error event and [DONE])
    cleanup   cleanup_ctx: engine.stop()                (a no-op by then; the same path on a
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
from pathlib import Path

from aiohttp import web

from inferd.api.auth import auth_middleware, principal_of
from inferd.api.errors import error_middleware
from inferd.api.logs import request_log_middleware
from inferd.api.metrics import setup_metrics
from inferd.api.probe import InferenceProbe
from inferd.api.request_log import setup_request_log
from inferd.api.door import FrontDoor
from inferd.api.gateway import Gateway
from inferd.api.logprobs import TokenTexts
from inferd.api.routes import add_routes
from inferd.api.resume import StreamRegistry
from inferd.api.state import (DOOR, ENGINE, GATEWAY, RESUMABLE, SETTINGS, SSE_RESPONSES, STATE, TOKEN_TEXTS,
                              ServerState)
from inferd.api.tenants import Keyring
from inferd.config import Settings
from inferd.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

PROBE = web.AppKey("probe", InferenceProbe)

MAX_BODY_BYTES = 32 * 2**20  # a batch of long token-id prompts is large JSON
STREAMS_END_SECONDS = 5.0  # how long shutdown waits for open streams to write their last event


def served_name(settings: Settings, model_path: str) -> str:
    """The model name clients send: the setting, else the file's stem or the folder's name."""
    if settings.model.name:
        return settings.model.name
    path = Path(model_path)
    return path.stem if path.is_file() else path.name


def create_app(engine: AsyncEngine, settings: Settings, api_keys: frozenset[str] = frozenset(),
               reload_keys: Callable[[], Keyring] | None = None) -> web.Application:
    """The app over `engine`: tenants and admin keys from `settings`, plain keys as `api_keys`
    (hex digests); `reload_keys` re-reads them all (SIGHUP, POST /admin/reload)."""
    gateway = Gateway(Keyring.build(settings, api_keys), engine.limits.policy, reload_keys)
    server = settings.server
    # outermost first: the request log sees the final status, which the error middleware renders
    middlewares = [request_log_middleware, error_middleware,
                   auth_middleware(lambda: gateway.keyring, server.open_paths, server.status_admin_only)]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app[DOOR] = FrontDoor(engine)
    app[GATEWAY] = gateway
    app[SETTINGS] = settings
    app[TOKEN_TEXTS] = TokenTexts(engine.tokenizer)
    app[SSE_RESPONSES] = set()
    app[RESUMABLE] = StreamRegistry(server.resume_grace_seconds, server.resume_max_streams, server.keepalive_seconds,
                                    app[SSE_RESPONSES])
    app[STATE] = ServerState(served_name(settings, engine.limits.model_path))
    add_routes(app)
    setup_request_log(app, settings.request_log, app[STATE].model_name)  # before the metrics, which read it
    setup_metrics(app)
    app.on_response_prepare.append(_rate_limit_headers)
    app.cleanup_ctx.append(_engine_lifecycle)
    app.on_shutdown.append(_end_streams)
    return app


async def _rate_limit_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every response to a tenant carries its x-ratelimit-* headers, as its buckets stand when
    the headers go out (after the refund, for a whole reply)."""
    principal = principal_of(request)
    if principal.tenant is not None:
        response.headers.update(request.app[GATEWAY].headers(principal))


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE]
    app[DOOR].open()
    await engine.start()
    probe = InferenceProbe(engine, app[STATE], app[SETTINGS].server.probe_interval_seconds)
    app[PROBE] = probe
    probing = asyncio.ensure_future(probe.run())
    yield
    probing.cancel()
    await engine.stop()


async def _end_streams(app: web.Application) -> None:
    open_streams = app[SSE_RESPONSES]
    if open_streams:
        log.info("shutting down: ending %d open streams", len(open_streams))
    app[STATE].draining = True
    app[DOOR].start_draining()  # new requests: 503 with a Retry-After
    await app[ENGINE].stop()  # every unfinished request gets an abort output
    deadline = time.monotonic() + STREAMS_END_SECONDS
    while open_streams and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if open_streams:
        log.warning("%d streams did not end within %.0f s", len(open_streams), STREAMS_END_SECONDS)
    app[RESUMABLE].close()  # (detached resumable streams: their requests ended with the engine)
