"""The route table, the small endpoints (models, health, status) and the OpenAPI document.

    POST /v1/completions       completions.py      GET /v1/models     the served model
    POST /v1/chat/completions  chat.py             GET /v1/status     engine stats snapshot
    GET  /openapi.json         from protocol.py    GET /health        200 while the engine runs
"""

from __future__ import annotations

import functools
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from inferd import __version__
from inferd.api import protocol as p
from inferd.api.chat import create_chat_completion
from inferd.api.completions import create_completion
from inferd.api.serving import ENGINE

_STARTED = 0  # ModelCard.created: fixed, as nothing here knows when the weights were made


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    models = p.ModelList(data=[p.ModelCard(id=engine.model_name, created=_STARTED, max_model_len=engine.max_model_len)])
    return web.json_response(p.dump(models))


async def health(request: web.Request) -> web.Response:
    if request.app[ENGINE].alive:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unavailable"}, status=503, headers={"Retry-After": "5"})


async def status(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    stats = engine.stats
    rejections: dict[str, dict[str, int]] = {}
    for (name, reason), count in engine.engine.admission.rejections.items():
        rejections.setdefault(name, {})[reason] = count
    classes = [
        p.ClassStatus(
            name=c.name, priority=c.priority, waiting=c.waiting, queued_tokens=c.queued_tokens,
            oldest_wait_seconds=c.oldest_wait, running=c.running, kv_blocks_used=c.kv_blocks_used,
            queued_token_seconds=c.queued_token_seconds, prompt_tokens=c.prompt_tokens,
            cached_prompt_tokens=c.cached_prompt_tokens, generation_tokens=c.generation_tokens,
            ttft_p50_seconds=c.ttft_p50, ttft_p95_seconds=c.ttft_p95, tpot_p50_seconds=c.tpot_p50,
            queue_time_p95_seconds=c.queue_time_p95, finished=c.finished, preemptions=c.preemptions,
            timeouts=c.timeouts, rejections=rejections.get(c.name, {}), deadline_misses=c.deadline_misses,
        )
        for c in stats.classes
    ]
    body = p.StatusResponse(
        model=engine.model_name,
        max_model_len=engine.max_model_len,
        kv_blocks_total=stats.kv_blocks_total,
        kv_blocks_used=stats.kv_blocks_used,
        kv_blocks_cached=stats.kv_blocks_cached,
        running=stats.running,
        waiting=stats.waiting,
        steps=stats.steps,
        preemptions=stats.preemptions,
        timeouts=stats.timeouts,
        rejections=stats.rejections,
        prefix_cache_queries=stats.prefix_queries,
        prefix_cache_hits=stats.prefix_hits,
        shed_level=stats.shed_level,
        shed_actions=stats.shed_actions,
        classes=classes,
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
    app.router.add_get("/openapi.json", openapi)


# ---------------------------------------------------------------------------------- OpenAPI

_REQUESTS: tuple[type[BaseModel], ...] = (p.CompletionRequest, p.ChatCompletionRequest)
_SCHEMAS: list[type[BaseModel]] = [
    *_REQUESTS,
    p.CompletionResponse, p.CompletionStreamResponse, p.ChatCompletionResponse, p.ChatCompletionChunk,
    p.ModelList, p.ErrorResponse, p.HealthResponse, p.StatusResponse, p.ClassStatus,
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
                "503": _json(p.HealthResponse, "the engine stopped")}}},
        },
        "components": {
            "schemas": schema.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
