"""The route table, the small endpoints (models, health, status) and the OpenAPI document.

    POST /v1/completions       completions.py      GET /v1/models     the served model
    POST /v1/chat/completions  chat.py             GET /v1/status     engine stats snapshot
    GET  /openapi.json         from protocol.py    GET /health        liveness: the engine loop beats
                                                   GET /ready         readiness: probed, not draining
"""

from __future__ import annotations

import functools
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from inferd import __version__
from inferd.api import protocol as p
from inferd.api.chat import create_chat_completion
from inferd.api.completions import create_completion
from inferd.api.state import DOOR, ENGINE, SETTINGS, STATE
from inferd.engine.policy import PriorityClass

_STARTED = 0  # ModelCard.created: fixed, as nothing here knows when the weights were made


async def list_models(request: web.Request) -> web.Response:
    name, limits = request.app[STATE].model_name, request.app[ENGINE].limits
    models = p.ModelList(data=[p.ModelCard(id=name, created=_STARTED, max_model_len=limits.max_model_len)])
    return web.json_response(p.dump(models))


async def health(request: web.Request) -> web.Response:
    """Liveness: the engine thread runs, its loop went round recently (a hung step fails it) and
    it is not failing step after step (health.liveness_failures in a row fail it)."""
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    stalled = time.monotonic() - engine.last_beat > settings.server.liveness_seconds
    failing = engine.snapshot.consecutive_step_failures >= settings.health.liveness_failures
    if engine.alive and not stalled and not failing:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unavailable"}, status=503, headers={"Retry-After": "5"})


async def ready(request: web.Request) -> web.Response:
    """Readiness: loaded, the inference probe passes, the engine is not failing steps, not
    draining; else 503 with the reason."""
    state, engine = request.app[STATE], request.app[ENGINE]
    name = state.name(engine)
    if name == "ready":
        return web.json_response({"status": name})
    body: dict[str, str] = {"status": name}
    if state.probe_error is not None:
        body["reason"] = state.probe_error
    elif not engine.snapshot.healthy:
        failed = engine.snapshot.consecutive_step_failures
        body["reason"] = (f"the engine failed {failed} steps in a row" if failed
                          else "the engine failed steps in a row recently; recovering")
    return web.json_response(body, status=503, headers={"Retry-After": "5"})


def _limits(cls: PriorityClass) -> p.ClassLimits:
    t = cls.timeouts
    return p.ClassLimits(
        max_waiting=cls.max_waiting, max_queued_tokens=cls.max_queued_tokens, ttft_target=cls.ttft_target,
        tpot_target=cls.tpot_target, queue_timeout=t.queue, ttft_timeout=t.ttft, token_timeout=t.token,
        total_timeout=t.total, max_tokens=cls.max_tokens, kv_reserve=cls.kv_reserve, sheddable=cls.sheddable,
    )


def _classes(request: web.Request) -> list[p.ClassStatus]:
    engine, door = request.app[ENGINE], request.app[DOOR]
    rejections: dict[str, dict[str, int]] = {}
    for (name, reason), count in door.admission.rejections.items():
        rejections.setdefault(name, {})[reason] = count
    return [
        p.ClassStatus(
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
    engine, state = request.app[ENGINE], request.app[STATE]
    stats, limits = engine.snapshot, engine.limits
    now = time.monotonic()
    generation_rate, prompt_rate = engine.throughput.rates(now)
    requests = [
        p.RequestStatus(id=r.group_id, index=r.index, class_=r.class_name, state=r.state, age_seconds=r.age,
                        prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens, ttft_seconds=r.ttft)
        for r in stats.requests
    ]
    memory = stats.device_memory
    body = p.StatusResponse(
        model=state.model_name, dtype=limits.dtype, device=limits.device, version=__version__,
        uptime_seconds=now - state.started, state=state.name(engine), max_model_len=limits.max_model_len,
        kv_blocks_total=stats.kv_blocks_total, kv_blocks_used=stats.kv_blocks_used,
        kv_blocks_cached=stats.kv_blocks_cached, running=stats.running, waiting=stats.waiting, steps=stats.steps,
        preemptions=stats.preemptions, timeouts=stats.timeouts, rejections=request.app[DOOR].rejections(),
        prefix_cache_queries=stats.prefix_queries, prefix_cache_hits=stats.prefix_hits,
        shed_level=stats.shed_level, shed_actions=stats.shed_actions,
        kv_usage_ratio=stats.kv_usage_ratio,
        throughput=p.Throughput(generation_tokens_per_second=generation_rate, prompt_tokens_per_second=prompt_rate,
                                history=engine.throughput.history(now)),
        device_memory=None if memory is None else p.DeviceMemory(used_bytes=memory.used_bytes,
                                                                  total_bytes=memory.total_bytes),
        engine_healthy=stats.healthy, step_failures=stats.step_failures,
        oom_events_last_minute=stats.oom_events_last_minute, token_budget=stats.token_budget,
        classes=_classes(request),
        requests=requests,
    )
    return web.json_response(p.dump(body))


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/openapi.json", openapi)


# ---------------------------------------------------------------------------------- OpenAPI

_REQUESTS: tuple[type[BaseModel], ...] = (p.CompletionRequest, p.ChatCompletionRequest)
_SCHEMAS: list[type[BaseModel]] = [
    *_REQUESTS,
    p.CompletionResponse, p.CompletionStreamResponse, p.ChatCompletionResponse, p.ChatCompletionChunk,
    p.ModelList, p.ErrorResponse, p.HealthResponse, p.ReadyResponse, p.StatusResponse
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


_ERRORS = {
    "400": _json(p.ErrorResponse, "invalid request"),
    "401": _json(p.ErrorResponse, "missing or wrong API key"),
    "404": _json(p.ErrorResponse, "unknown model"),
    "429": _json(p.ErrorResponse, "the class's queue is full, it is being shed, or the request would miss its "
                                  "TTFT deadline; Retry-After says when to come back"),
    "503": _json(p.ErrorResponse, "the engine is not running, the server is draining, or the request timed out "
                                  "before its first token; Retry-After says when to come back"),
}


def _generate(summary: str, request: type[BaseModel], response: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {
                "description": f"a {response.__name__}; with stream=true, server-sent events: one "
                               f"{chunk.__name__} per `data:` line, then `data: [DONE]`",
                "content": {"application/json": {"schema": _ref(response)},
                            "text/event-stream": {"schema": _ref(chunk)}},
            },
            **_ERRORS,
        },
    }}


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
        "paths": {
            "/v1/completions": _generate("Create a completion", p.CompletionRequest, p.CompletionResponse,
                                         p.CompletionStreamResponse),
            "/v1/chat/completions": _generate("Create a chat completion", p.ChatCompletionRequest,
                                              p.ChatCompletionResponse, p.ChatCompletionChunk),
            "/v1/models": {"get": {"summary": "List the served model", "responses": {"200": _json(p.ModelList, "the model")}}},
            "/v1/status": {"get": {"summary": "Engine statistics",
                                   "responses": {"200": _json(p.StatusResponse, "a snapshot")}}},
            "/health": {"get": {"summary": "Liveness", "responses": {
                "200": _json(p.HealthResponse, "the engine runs"),
                "503": _json(p.HealthResponse, "the engine stopped, or its loop hangs")}}},
            "/ready": {"get": {"summary": "Readiness", "responses": {
                "200": _json(p.ReadyResponse, "loaded, the inference probe passes, not draining"),
                "503": _json(p.ReadyResponse, "loading, draining, or the inference probe fails")}}},
        },
        "components": {
            "schemas": schema.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
