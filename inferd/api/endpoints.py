"""The endpoint table: every HTTP path, and the small endpoints of the server's own life. ("Routes" in
inferd are model routes: routing/routes.py, [routes.NAME].)

    POST /v1/completions, /v1/chat/completions,    openai/ (the OpenAI protocol, over the shared
         /tokenize, /detokenize; GET /v1/models     generation path of pipeline/)
    POST /v1/messages, /v1/messages/count_tokens   anthropic/ (Anthropic's Messages, the same path)
    POST /v1/responses; GET, DELETE                responses/ (OpenAI's Responses, the same path, and
         /v1/responses/<id>; POST .../cancel       its store of responses)
    GET  /v1/status                                telemetry/status.py: engine stats snapshot
    GET  /metrics                                  telemetry/metrics.py: Prometheus text format
    GET  /health                                   here: liveness, the engine loops beat
    GET  /ready                                    here: readiness, probed and not draining
    GET  /openapi.json                             openapi.py
    GET, DELETE /v1/streams/<id>                   streaming/resume.py: resume or cancel a stream
    /admin/tenants, /admin/reload, /admin/models/<name>/reload, /rollback   admin.py (admin key)

Each protocol package adds its endpoints here.
"""

from __future__ import annotations

import time

from aiohttp import web

from inferd.api.admin import add_admin_endpoints
from inferd.api.anthropic.endpoints import add_anthropic_endpoints
from inferd.api.openai.endpoints import add_openai_endpoints
from inferd.api.openapi import openapi
from inferd.api.responses.create import add_responses_endpoints
from inferd.api.routing.registry import REGISTRY
from inferd.api.state import SETTINGS
from inferd.api.streaming.resume import RESUMABLE
from inferd.api.telemetry.status import status


async def health(request: web.Request) -> web.Response:
    """Liveness: every model's engine thread runs, its loop went round recently (a hung step
    fails it) and it is not failing step after step (health.liveness_failures in a row)."""
    settings, now = request.app[SETTINGS], time.monotonic()
    for slot in request.app[REGISTRY].slots.values():
        if (served := slot.serving) is None:
            continue  # (not loaded, asleep or moving: no engine thread to look at)
        engine = served.engine
        stalled = now - engine.last_beat > settings.server.liveness_seconds
        failing = engine.snapshot.consecutive_step_failures >= settings.health.liveness_failures
        if not engine.alive or stalled or failing:
            return web.json_response({"status": "unavailable"}, status=503, headers={"Retry-After": "5"})
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Readiness (ModelRegistry.readiness); 503 with the reason otherwise."""
    name, reason = request.app[REGISTRY].readiness()
    if name == "ready":
        return web.json_response({"status": name})
    body = {"status": name} if reason is None else {"status": name, "reason": reason}
    return web.json_response(body, status=503, headers={"Retry-After": "5"})


async def resume_stream(request: web.Request) -> web.StreamResponse:
    return await request.app[RESUMABLE].resume(request)


async def delete_stream(request: web.Request) -> web.StreamResponse:
    return await request.app[RESUMABLE].delete(request)


def add_endpoints(app: web.Application) -> None:
    add_openai_endpoints(app)
    add_anthropic_endpoints(app)
    add_responses_endpoints(app)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/v1/streams/{response_id}", resume_stream)
    app.router.add_delete("/v1/streams/{response_id}", delete_stream)
    add_admin_endpoints(app)
