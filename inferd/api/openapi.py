"""GET /openapi.json: OpenAPI 3.1, from the same pydantic models that validate requests and
build replies (the OpenAI protocol's, Anthropic's Messages, the status page's, the error bodies)."""

from __future__ import annotations

import functools
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from inferd import __version__
from inferd.api.anthropic import wire as aw
from inferd.api.responses import wire as rw
from inferd.api.openai import chat_wire as cp
from inferd.api.openai import pooling_wire as pw
from inferd.api.openai import wire as p
from inferd.api.openai.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from inferd.api.telemetry import status_wire as s
from inferd.api.wire import ErrorResponse


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


_REQUESTS: tuple[type[BaseModel], ...] = (p.CompletionRequest, cp.ChatCompletionRequest, TokenizeCompletionRequest,
                                          TokenizeChatRequest, DetokenizeRequest, aw.MessagesRequest,
                                          aw.CountTokensRequest, rw.ResponsesRequest, pw.EmbeddingRequest,
                                          pw.RerankRequest, pw.ScoreRequest)
_SCHEMAS: list[type[BaseModel]] = [
    *_REQUESTS,
    p.CompletionResponse, p.CompletionStreamResponse, cp.ChatCompletionResponse, cp.ChatCompletionChunk,
    p.ModelList, p.ModelCard, ErrorResponse, s.HealthResponse, s.ReadyResponse, s.StatusResponse, TokenizeResponse,
    DetokenizeResponse, TokenizerInfo, aw.MessageResponse, aw.CountTokensResponse, aw.AnthropicErrorResponse,
    rw.Response, pw.EmbeddingResponse, pw.RerankResponse, pw.ScoreResponse,
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


def _error(description: str) -> dict[str, Any]:
    return _json(ErrorResponse, description)


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
    "422": _error("the model, loaded on demand, failed to load (code model_load_failed, the reason named)"),
    "503": _error("the engine is not running, the server is draining, the request timed out before its first "
                  "token, or its model did not load or wake within model_load_wait_seconds (codes "
                  "model_loading, model_asleep); Retry-After says when to come back"),
}


def _anthropic(summary: str, request: type[BaseModel], response: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages path: its errors in Anthropic's shape and codes (anthropic/errors.py),
    its key in x-api-key or Authorization: Bearer."""
    errors = {code: _json(aw.AnthropicErrorResponse, text) for code, text in (
        ("400", "invalid request"), ("401", "missing or wrong API key (when keys are configured)"),
        ("403", "the key's tenant may not use this model or class"), ("404", "unknown model"),
        ("413", "the request body is larger than 32 MiB"), ("429", "rate limited, or the queue is full; retry-after"),
        ("504", "the request timed out before its first token"),
        ("529", "overloaded: the engine is not running, or the server is draining; retry-after"))}
    operation = _post(summary, _ref(request), {"200": response, **errors})
    operation["post"]["security"] = [{"bearer": []}, {"x-api-key": []}]
    return operation


ANTHROPIC_EVENTS = ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                    "message_delta", "message_stop", "error"]
RESPONSES_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                    "response.content_part.done", "response.function_call_arguments.delta",
                    "response.function_call_arguments.done", "response.output_item.done", "response.completed",
                    "response.incomplete", "error"]


def _named_events(names: list[str]) -> dict[str, Any]:
    """A stream of named events (`event: message_start`, ...), each `data:` one JSON object."""
    return {"type": "object", "required": ["event", "data"], "properties": {
        "id": {"type": "string"}, "event": {"enum": names},
        "data": {"type": "string", "contentMediaType": "application/json"}}}


def _event(*chunks: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream (before OpenAPI 3.2, a text/event-stream `schema`
    describes each event): `id: <response id>:<sequence number>` and `data:` a chunk, an error
    that ends the stream, or [DONE]."""
    payload = {"contentMediaType": "application/json",
               "contentSchema": {"anyOf": [*map(_ref, chunks), _ref(ErrorResponse)]}}
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


def _pooling() -> dict[str, Any]:
    """The pooling paths: prompt-only requests, answered whole (no stream)."""
    wrong_task = "invalid request, or a model that does not serve the task (code wrong_task)"
    return {
        "/v1/embeddings": _post("Create embeddings (a model with a pooler)", _ref(pw.EmbeddingRequest), {
            "200": _json(pw.EmbeddingResponse, "each input's vector (base64: little-endian float32)"), **_ERRORS,
            "400": _error(wrong_task)}),
        "/v1/rerank": _post("Rank documents by relevance to a query (a reranker: task score)", _ref(pw.RerankRequest),
                            {"200": _json(pw.RerankResponse, "the documents' scores, best first"), **_ERRORS,
                             "400": _error(wrong_task)}),
        "/v1/score": _post("Score text pairs, 1 to N or N to N (a reranker: task score)", _ref(pw.ScoreRequest),
                           {"200": _json(pw.ScoreResponse, "each pair's score"), **_ERRORS, "400": _error(wrong_task)}),
    }


def _agent_protocols() -> dict[str, Any]:
    """Anthropic's Messages and OpenAI's Responses paths."""
    return {
        "/v1/messages": _anthropic("Create a message (Anthropic's Messages API)", aw.MessagesRequest, {
            "description": "a MessageResponse; with stream=true, Anthropic's named server-sent events",
            "content": {"application/json": {"schema": _ref(aw.MessageResponse)},
                        "text/event-stream": {"schema": _named_events(ANTHROPIC_EVENTS)}}}),
        "/v1/messages/count_tokens": _anthropic("Count a message's prompt tokens (Anthropic's)", aw.CountTokensRequest,
                                                _json(aw.CountTokensResponse, "the prompt's size")),
        "/v1/responses": _post("Create a response (OpenAI's Responses API), kept with store, generated on with "
                               "background", _ref(rw.ResponsesRequest), {
            "200": {"description": "a Response (a background one as it starts: queued); with stream=true, its "
                                   "events, each with a sequence_number",
                    "content": {"application/json": {"schema": _ref(rw.Response)},
                                "text/event-stream": {"schema": _named_events(RESPONSES_EVENTS)}}},
            **_ERRORS, "404": _error("unknown model, or a previous_response_id this caller has not stored "
                                     "(unknown, expired, evicted or deleted)"),
            "429": _error("as for every generation, or (code store_full) responses.max_per_tenant background "
                          "responses of this caller's are running; Retry-After says when to come back")}),
        **_stored_responses(),
    }


def _stored_responses() -> dict[str, Any]:
    """GET / DELETE /v1/responses/{response_id} and its /cancel: a stored response (responses/stored.py)."""
    response_id = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"},
                   "description": "a response kept with store (or background)"}
    replay = [{"name": "stream", "in": "query", "schema": {"type": "boolean"},
               "description": "a background response's events instead, then the live ones"},
              {"name": "starting_after", "in": "query", "schema": {"type": "integer", "minimum": -1},
               "description": "with stream: the sequence number of the last event received (default: none)"},
              {"name": "include", "in": "query", "schema": {"type": "array", "items": {"type": "string"}},
               "description": "accepted (the stored response is whole)"},
              {"name": "include_obfuscation", "in": "query", "schema": {"type": "boolean"},
               "description": "accepted (no obfuscation is added)"}]
    missing = {"404": _error("no such response stored for this caller (unknown, expired, evicted, deleted, or "
                             "another tenant's)")}
    response = _json(rw.Response, "the response (a running one as it stands: queued or in_progress)")
    deleted = {"type": "object", "required": ["id", "object", "deleted"], "properties": {
        "id": {"type": "string"}, "object": {"const": "response.deleted"}, "deleted": {"const": True}}}
    return {
        "/v1/responses/{response_id}": {
            "get": {"summary": "Retrieve a stored response, or replay and follow a background one's events",
                    "parameters": [response_id, *replay], "responses": {
                        "200": {"description": "the Response; with stream=true, its events after starting_after",
                                "content": {"application/json": {"schema": _ref(rw.Response)},
                                            "text/event-stream": {"schema": _named_events(RESPONSES_EVENTS)}}},
                        "400": _error("stream on a response that is not a background one, or starting_after names "
                                      "no event of it"), **_UNAUTHORIZED, **missing}},
            "delete": {"summary": "Delete a stored response (a running background one is cancelled)",
                       "parameters": [response_id], "responses": {
                           "200": {"description": "deleted", "content": {"application/json": {"schema": deleted}}},
                           **_UNAUTHORIZED, **missing}}},
        "/v1/responses/{response_id}/cancel": {"post": {
            "summary": "Cancel a running background response (an ended one is answered as it is)",
            "parameters": [response_id], "responses": {
                "200": response, "400": _error("the response is not a background one"), **_UNAUTHORIZED,
                **missing}}},
    }


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
        **_pooling(),
        **_agent_protocols(),
        "/v1/streams/{response_id}": _streams(),
        "/v1/models": _get("List the served models, aliases and routes", {"200": _json(p.ModelList, "the models")}),
        "/v1/models/{model}": {"get": {
            "summary": "One served model, alias or route", "parameters": [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": _json(p.ModelCard, "its card"), "404": _error("no model, alias or route of that name"),
                          **_UNAUTHORIZED}}},
        "/tokenizer_info": {"get": {
            "summary": "A model's special tokens, chat template and context length (vLLM's)", "parameters": [
                {"name": "model", "in": "query", "schema": {"type": "string"}, "description": "default: the first model"}],
            "responses": {"200": _json(TokenizerInfo, "the tokenizer's information"),
                          "404": _error("no model of that name"), **_UNAUTHORIZED}}},
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
        "/admin/models/{name}/sleep": _sleep_wake(
            "Put a model to sleep: level 1 frees its KV cache, 2 its weights too; requests then wait for the wake "
            "(admin key)", {"type": "object", "additionalProperties": False, "properties": {
                "level": {"type": "integer", "enum": [1, 2], "default": 1}}}),
        "/admin/models/{name}/wake": _sleep_wake("Wake a model (or load one not loaded) (admin key)", None),
    }


def _revision_change(summary: str, body: dict[str, Any] | None) -> dict[str, Any]:
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}, "description": "a model"}
    served = {"type": "object", "required": ["model", "revision", "path", "reloaded"], "properties": {
        "model": {"type": "string"}, "revision": {"type": "string"}, "path": {"type": "string"},
        "reloaded": {"type": "boolean"}, "state": {"type": "string"}}}
    post: dict[str, Any] = {"summary": summary, "parameters": [name], "responses": {
        "200": {"description": "the revision now serving", "content": {"application/json": {"schema": served}}},
        "400": _error("an invalid body"), **_UNAUTHORIZED, **_FORBIDDEN, "404": _error("no such model"),
        "409": _error("no previous revision (rollback)"),
        "422": _error("the revision was rejected (it did not load, or failed its probe or evaluation set); "
                      "the old one keeps serving")}}
    if body is not None:
        post["requestBody"] = {"required": False, "content": {"application/json": {"schema": body}}}
    return {"post": post}


def _sleep_wake(summary: str, body: dict[str, Any] | None) -> dict[str, Any]:
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}, "description": "a model"}
    state = {"type": "object", "required": ["model", "state", "seconds"], "properties": {
        "model": {"type": "string"}, "state": {"type": "string"}, "level": {"type": "integer"},
        "seconds": {"type": "number"}, "kv_cache_bytes_freed": {"type": ["integer", "null"]}}}
    post: dict[str, Any] = {"summary": summary, "parameters": [name], "responses": {
        "200": {"description": "the model's state now", "content": {"application/json": {"schema": state}}},
        "400": _error("an invalid body"), **_UNAUTHORIZED, **_FORBIDDEN, "404": _error("no such model"),
        "409": _error("the model was still loading or unloading after model_load_wait_seconds, or level 2 on a "
                      "server that cannot load it again"),
        "422": _error("the wake's load failed (model_load_failed, model_wake_failed), the reason named")}}
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
                 "description": "An OpenAI-compatible LLM inference server (and Anthropic's Messages API)."},
        "paths": _paths(),
        "components": {
            "schemas": schema.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
        },
        "security": [{"bearer": []}],
    }
