"""The route table, the small endpoints (models, health, status) and the OpenAPI document.

    POST /v1/completions       completions.py      GET /v1/models     the served model
    POST /v1/chat/completions  chat.py             GET /v1/status     engine stats snapshot
    POST /tokenize             tokenize.py         GET /health        liveness: the engine loop beats
    POST /detokenize           tokenize.py         GET /ready         readiness: probed, not draining
    GET  /openapi.json         from the pydantic models (protocol.py, chat_protocol.py, status_protocol.py)
    GET  /admin/tenants        admin.py (admin key)   POST /admin/reload   keys and tenants read again
    POST /admin/models/<name>/reload, /rollback       reload.py (admin key): a new revision, or the previous
    GET, DELETE /v1/streams/<id>  resume.py: resume or cancel a resumable stream
"""

from __future__ import annotations

import functools
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from inferd import __version__
from inferd.api import chat_protocol as cp
from inferd.api import protocol as p
from inferd.api import status_protocol as s
from inferd.api.admin import add_admin_routes, tenant_statuses, visible_tenant
from inferd.api.auth import principal_of
from inferd.api.chat import create_chat_completion
from inferd.api.completions import create_completion
from inferd.api.request_log import REQUEST_JOURNAL
from inferd.api.fleet import FLEET, Fleet
from inferd.api.reload import add_reload_routes
from inferd.api.state import GATEWAY, RESUMABLE, SETTINGS, STATE, ServerState
from inferd.api.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)
from inferd.engine.policy import PriorityClass

_STARTED = 0  # ModelCard.created: fixed, as nothing here knows when the weights were made


async def list_models(request: web.Request) -> web.Response:
    """Every served name: models (with their revision), aliases, routes."""
    fleet = request.app[FLEET]
    cards = []
    for slot in fleet.slots.values():
        spec, limits = slot.current.spec, slot.current.engine.limits
        cards.append(p.ModelCard(id=slot.name, created=_STARTED, max_model_len=limits.max_model_len,
                                 revision=spec.revision))
        cards += [p.ModelCard(id=alias, created=_STARTED, max_model_len=limits.max_model_len, revision=spec.revision,
                              alias_of=slot.name) for alias in spec.aliases]
    cards += [p.ModelCard(id=name, created=_STARTED, route=route.shares()) for name, route in fleet.routes.items()]
    return web.json_response(p.dump(p.ModelList(data=cards)))


async def health(request: web.Request) -> web.Response:
    """Liveness: every model's engine thread runs, its loop went round recently (a hung step
    fails it) and it is not failing step after step (health.liveness_failures in a row)."""
    settings, now = request.app[SETTINGS], time.monotonic()
    for slot in request.app[FLEET].slots.values():
        engine = slot.current.engine
        stalled = now - engine.last_beat > settings.server.liveness_seconds
        failing = engine.snapshot.consecutive_step_failures >= settings.health.liveness_failures
        if not engine.alive or stalled or failing:
            return web.json_response({"status": "unavailable"}, status=503, headers={"Retry-After": "5"})
    return web.json_response({"status": "ok"})


def readiness(state: ServerState, fleet: Fleet) -> tuple[str, str | None]:
    """(state, reason): ready once every model has been probed, unless draining or a model that
    has no fallback fails its probe or its steps (one with a fallback is served by it)."""
    if state.draining:
        return "draining", None
    for slot in fleet.slots.values():
        served = slot.current
        if slot.current.spec.fallback is not None and served.engine.alive:
            continue
        if served.health.probe_error is not None:
            return "not_ready", served.health.probe_error
        if not served.engine.alive:
            return "not_ready", f"the engine of {slot.name} stopped"
        if not served.engine.snapshot.healthy:
            failed = served.engine.snapshot.consecutive_step_failures
            return "not_ready", (f"the engine failed {failed} steps in a row" if failed
                                 else "the engine failed steps in a row recently; recovering")
    return ("ready" if state.probed else "loading"), None


async def ready(request: web.Request) -> web.Response:
    """Readiness (`readiness`); 503 with the reason otherwise."""
    name, reason = readiness(request.app[STATE], request.app[FLEET])
    if name == "ready":
        return web.json_response({"status": name})
    body = {"status": name} if reason is None else {"status": name, "reason": reason}
    return web.json_response(body, status=503, headers={"Retry-After": "5"})


def _limits(cls: PriorityClass) -> s.ClassLimits:
    t = cls.timeouts
    return s.ClassLimits(
        max_waiting=cls.max_waiting, max_queued_tokens=cls.max_queued_tokens, ttft_target=cls.ttft_target,
        tpot_target=cls.tpot_target, queue_timeout=t.queue, ttft_timeout=t.ttft, token_timeout=t.token,
        total_timeout=t.total, max_tokens=cls.max_tokens, kv_reserve=cls.kv_reserve, sheddable=cls.sheddable,
    )


def _classes(request: web.Request) -> list[s.ClassStatus]:
    primary = request.app[FLEET].primary.current
    engine, door = primary.engine, primary.door
    rejections: dict[str, dict[str, int]] = {}
    for (name, reason), count in door.admission.rejections.items():
        rejections.setdefault(name, {})[reason] = count
    return [
        s.ClassStatus(
            name=c.name, priority=c.priority, waiting=c.waiting, queued_tokens=c.queued_tokens,
            oldest_wait_seconds=c.oldest_wait, running=c.running, kv_blocks_used=c.kv_blocks_used,
            queued_token_seconds=c.queued_token_seconds, prompt_tokens=c.prompt_tokens,
            cached_prompt_tokens=c.cached_prompt_tokens, generation_tokens=c.generation_tokens,
            ttft_p50_seconds=c.ttft_p50, ttft_p95_seconds=c.ttft_p95, tpot_p50_seconds=c.tpot_p50,
            queue_time_p95_seconds=c.queue_time_p95, finished=c.finished, preemptions=c.preemptions,
            timeouts=c.timeouts, rejections=rejections.get(c.name, {}), deadline_misses=c.deadline_misses,
            limits=_limits(engine.limits.priority_class(c.name)),
        )
        for c in engine.snapshot.classes
    ]


async def status(request: web.Request) -> web.Response:
    fleet, state = request.app[FLEET], request.app[STATE]
    primary = fleet.primary.current
    engine = primary.engine
    stats, limits = engine.snapshot, engine.limits
    now = time.monotonic()
    generation_rate, prompt_rate = engine.throughput.rates(now)
    only = visible_tenant(principal_of(request))  # a tenant sees its own requests and row only
    requests = [
        s.RequestStatus(id=r.group_id, index=r.index, class_=r.class_name, state=r.state, age_seconds=r.age,
                        prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens, ttft_seconds=r.ttft,
                        tenant=r.tenant)
        for r in stats.requests if only is None or r.tenant == only
    ]
    memory = stats.device_memory
    body = s.StatusResponse(
        model=state.model_name, dtype=limits.dtype, device=limits.device, version=__version__,
        uptime_seconds=now - state.started, state=readiness(state, fleet)[0], max_model_len=limits.max_model_len,
        kv_blocks_total=stats.kv_blocks_total, kv_blocks_used=stats.kv_blocks_used,
        kv_blocks_cached=stats.kv_blocks_cached, running=stats.running, waiting=stats.waiting, steps=stats.steps,
        preemptions=stats.preemptions, timeouts=stats.timeouts, rejections=primary.door.rejections(),
        prefix_cache_queries=stats.prefix_queries, prefix_cache_hits=stats.prefix_hits,
        shed_level=stats.shed_level, shed_actions=stats.shed_actions,
        kv_usage_ratio=stats.kv_usage_ratio,
        throughput=s.Throughput(generation_tokens_per_second=generation_rate, prompt_tokens_per_second=prompt_rate,
                                history=engine.throughput.history(now)),
        device_memory=None if memory is None else s.DeviceMemory(used_bytes=memory.used_bytes,
                                                                  total_bytes=memory.total_bytes),
        engine_healthy=stats.healthy, step_failures=stats.step_failures,
        oom_events_last_minute=stats.oom_events_last_minute, token_budget=stats.token_budget,
        resumable_streams_detached=request.app[RESUMABLE].detached,
        classes=_classes(request),
        requests=requests,
        tenants=tenant_statuses(request.app[GATEWAY], stats, only),
        drift=journal.drift.report() if (journal := request.app.get(REQUEST_JOURNAL)) and only is None else None,
        models=model_statuses(fleet),
        routes=[s.RouteStatus(name=name, kind="cascade" if r.cascade else "split", shares=r.shares())
                for name, r in fleet.routes.items()],
    )
    return web.json_response(p.dump(body))


def model_statuses(fleet: Fleet) -> list[s.ModelStatus]:
    out = []
    for slot in fleet.slots.values():
        served, counts = slot.current, slot.counts
        stats = served.engine.snapshot
        out.append(s.ModelStatus(
            name=slot.name, revision=served.spec.revision, aliases=list(served.spec.aliases),
            path=served.engine.limits.model_path, healthy=served.healthy, probe_error=served.health.probe_error,
            fallback=served.spec.fallback, degraded=slot.degradation.use_fallback,
            degraded_reason=slot.degradation.reason, functional_level=slot.ladder.name,
            previous_revision=None if slot.previous is None else slot.previous.revision,
            retiring_revisions=[r.spec.revision for r in slot.retiring], running=stats.running, waiting=stats.waiting,
            kv_blocks_used=stats.kv_blocks_used, kv_blocks_total=stats.kv_blocks_total, requests=counts.requests,
            fallbacks=counts.fallbacks, reloads=counts.reloads, reloads_refused=counts.reloads_refused,
            escalations=counts.escalations, tokens_saved=counts.tokens_saved,
        ))
    return out


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


async def resume_stream(request: web.Request) -> web.StreamResponse:
    return await request.app[RESUMABLE].resume(request)


async def delete_stream(request: web.Request) -> web.StreamResponse:
    return await request.app[RESUMABLE].delete(request)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/status", status)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/v1/streams/{response_id}", resume_stream)
    app.router.add_delete("/v1/streams/{response_id}", delete_stream)
    add_admin_routes(app)
    add_reload_routes(app)


# ---------------------------------------------------------------------------------- OpenAPI

_REQUESTS: tuple[type[BaseModel], ...] = (p.CompletionRequest, cp.ChatCompletionRequest, TokenizeCompletionRequest,
                                          TokenizeChatRequest, DetokenizeRequest)
_SCHEMAS: list[type[BaseModel]] = [
    *_REQUESTS,
    p.CompletionResponse, p.CompletionStreamResponse, cp.ChatCompletionResponse, cp.ChatCompletionChunk,
    p.ModelList, p.ErrorResponse, s.HealthResponse, s.ReadyResponse, s.StatusResponse, TokenizeResponse,
    DetokenizeResponse,
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


def _error(description: str) -> dict[str, Any]:
    return _json(p.ErrorResponse, description)


_UNAUTHORIZED = {"401": _error("missing or wrong API key (when keys are configured)")}
_INVALID = {
    "400": _error("invalid request"),
    **_UNAUTHORIZED,
    "404": _error("unknown model"),
    "413": _error("the request body is larger than 32 MiB"),
}
_FORBIDDEN = {"403": _error("the key's tenant may not use this model or class, or the path needs an admin key")}
_ERRORS = {
    **_INVALID,
    **_FORBIDDEN,
    "429": _error("the tenant's rate limit (code rate_limit_exceeded), or the class's queue is full, it is being "
                  "shed, the request would miss its TTFT deadline, or too many resumable streams are held; "
                  "Retry-After says when to come back"),
    "503": _error("the engine is not running, the server is draining, or the request timed out before its first "
                  "token; Retry-After says when to come back"),
}


def _event(*chunks: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream (before OpenAPI 3.2, a text/event-stream `schema`
    describes each event): `id: <response id>:<sequence number>` and `data:` a chunk, an error
    that ends the stream, or [DONE]."""
    payload = {"contentMediaType": "application/json",
               "contentSchema": {"anyOf": [*map(_ref, chunks), _ref(p.ErrorResponse)]}}
    return {"type": "object", "required": ["data"], "properties": {
        "id": {"type": "string", "pattern": "^(cmpl|chatcmpl)-[0-9a-f]{32}:[0-9]+$"},
        "event": {"const": "message"},
        "data": {"anyOf": [{"const": "[DONE]"}, {"type": "string", "not": {"const": "[DONE]"}, **payload}]},
    }}


def _post(summary: str, request: dict[str, Any], responses: dict[str, Any]) -> dict[str, Any]:
    body = {"required": True, "content": {"application/json": {"schema": request}}}
    return {"post": {"summary": summary, "requestBody": body, "responses": responses}}


def _generate(summary: str, request: type[BaseModel], response: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    return _post(summary, _ref(request), {
        "200": {
            "description": f"a {response.__name__}; with stream=true, server-sent events: one "
                           f"{chunk.__name__} per `data:` line, then `data: [DONE]`",
            "content": {"application/json": {"schema": _ref(response)}, "text/event-stream": {"schema": _event(chunk)}},
        },
        **_ERRORS,
    })


def _streams() -> dict[str, Any]:
    """GET (resume) and DELETE (cancel) /v1/streams/{response_id}: a resumable stream (resume.py)."""
    stream_id = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"},
                 "description": "the id of a response streamed with resumable: true"}
    after = [{"name": "after", "in": "query", "schema": {"type": "integer", "minimum": -1},
              "description": "the sequence number N of the last event received (its id is `<response id>:N`)"},
             {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"},
              "description": "the last event's id, as EventSource sends it (`after` wins); neither: from the start"}]
    missing = {"404": _error("no such stream held for this caller (unknown, ended, or past its grace period)")}
    replay = {"description": "the events after the one named, then the live ones, then `data: [DONE]`",
              "content": {"text/event-stream": {"schema": _event(p.CompletionStreamResponse, cp.ChatCompletionChunk)}}}
    deleted = {"type": "object", "required": ["id", "object", "deleted"], "properties": {
        "id": {"type": "string"}, "object": {"const": "stream"}, "deleted": {"const": True}}}
    return {
        "get": {"summary": "Resume a resumable stream", "parameters": [stream_id, *after], "responses": {
            "200": replay, "400": _error("after or Last-Event-ID names no event of this stream"),
            **_UNAUTHORIZED, **missing}},
        "delete": {"summary": "Cancel a resumable stream: its request aborted at once", "parameters": [stream_id],
                   "responses": {"200": {"description": "cancelled", "content": {"application/json": {
                       "schema": deleted}}}, **_UNAUTHORIZED, **missing}},
    }


def _get(summary: str, responses: dict[str, Any], *, open_path: bool = False) -> dict[str, Any]:
    """A GET; an open path (server.open_paths by default) needs no key, the others may answer 401."""
    if open_path:
        return {"get": {"summary": summary, "security": [], "responses": responses}}
    return {"get": {"summary": summary, "responses": {**responses, **_UNAUTHORIZED}}}


def _paths() -> dict[str, Any]:
    return {
        "/v1/completions": _generate("Create a completion", p.CompletionRequest, p.CompletionResponse,
                                     p.CompletionStreamResponse),
        "/v1/chat/completions": _generate("Create a chat completion", cp.ChatCompletionRequest,
                                          cp.ChatCompletionResponse, cp.ChatCompletionChunk),
        "/tokenize": _post("Tokenize a prompt, or chat messages through the chat template",
                           {"anyOf": [_ref(TokenizeCompletionRequest), _ref(TokenizeChatRequest)]},
                           {"200": _json(TokenizeResponse, "the token ids"), **_INVALID}),
        "/detokenize": _post("Token ids back to text", _ref(DetokenizeRequest),
                             {"200": _json(DetokenizeResponse, "the text"), **_INVALID}),
        "/v1/streams/{response_id}": _streams(),
        "/v1/models": _get("List the served models, aliases and routes", {"200": _json(p.ModelList, "the models")}),
        "/v1/status": _get("Engine statistics", {"200": _json(s.StatusResponse, "a snapshot")}),
        "/health": _get("Liveness", {"200": _json(s.HealthResponse, "the engine runs"),
                                     "503": _json(s.HealthResponse, "the engine stopped, or its loop hangs")},
                        open_path=True),
        "/ready": _get("Readiness", {"200": _json(s.ReadyResponse, "loaded, the inference probe passes, not draining"),
                                     "503": _json(s.ReadyResponse, "loading, draining, or the inference probe fails")},
                       open_path=True),
        "/metrics": _get("Prometheus metrics", {"200": {"description": "the text exposition format",
                                                        "content": {"text/plain": {"schema": {"type": "string"}}}}},
                         open_path=True),
        "/openapi.json": _get("This document", {"200": {"description": "OpenAPI 3.1", "content": {
            "application/json": {"schema": {"type": "object"}}}}}),
        "/admin/tenants": _get("Every tenant's configuration and status (admin key)", {
            "200": {"description": "the tenants", "content": {"application/json": {"schema": {"type": "object"}}}},
            **_FORBIDDEN}),
        "/admin/reload": {"post": {"summary": "Read the keys and tenants again, as SIGHUP does (admin key)",
                                   "responses": {"200": {"description": "the keys and tenants now served", "content": {
                                       "application/json": {"schema": {"type": "object"}}}},
                                                 "400": _error("the new settings are invalid; the old ones stay"),
                                                 **_UNAUTHORIZED, **_FORBIDDEN}}},
        "/admin/models/{name}/reload": _revision_change(
            "Load a new revision of a model beside the old one; it takes over once it passes its probe and "
            "evaluation set (admin key)", {"type": "object", "additionalProperties": False, "properties": {
                "path": {"type": "string"}, "revision": {"type": "string"}}}),
        "/admin/models/{name}/rollback": _revision_change("Return a model to its previous revision (admin key)", None),
    }


def _revision_change(summary: str, body: dict[str, Any] | None) -> dict[str, Any]:
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}, "description": "a model"}
    served = {"type": "object", "required": ["model", "revision", "path", "reloaded"], "properties": {
        "model": {"type": "string"}, "revision": {"type": "string"}, "path": {"type": "string"},
        "reloaded": {"type": "boolean"}}}
    post: dict[str, Any] = {"summary": summary, "parameters": [name], "responses": {
        "200": {"description": "the revision now serving", "content": {"application/json": {"schema": served}}},
        "400": _error("an invalid body"), **_UNAUTHORIZED, **_FORBIDDEN, "404": _error("no such model"),
        "409": _error("no previous revision (rollback)"),
        "422": _error("the revision was rejected (it did not load, or failed its probe or evaluation set); "
                      "the old one keeps serving")}}
    if body is not None:
        post["requestBody"] = {"required": False, "content": {"application/json": {"schema": body}}}
    return {"post": post}


@functools.cache
def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1, from the same pydantic models that validate requests and build replies."""
    _, schema = models_json_schema(
        [(m, "validation" if m in _REQUESTS else "serialization") for m in _SCHEMAS],
        ref_template="#/components/schemas/{model}",
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": "inferd", "version": __version__,
                 "description": "An OpenAI-compatible LLM inference server."},
        "paths": _paths(),
        "components": {
            "schemas": schema.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
