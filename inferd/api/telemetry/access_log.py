"""The access log: one structured line per API request at its end (logger `inferd.requests`), and the
JSON-lines format. (The request file, one JSON record per generation with its texts, is request_file.py.)

    inferd.requests INFO request id=cmpl-3f.. request_id=trace-42 path=/v1/completions status=200 class=interactive
        tenant=acme user=alice prompt_tokens=31 completion_tokens=64 queue_time=0.004 ttft=0.081 e2e=2.310
        finish=length

With `--log-format json` every record (these and the rest) is one JSON object per line, the
request fields as keys. Prompt text is never logged unless `server.log_prompts` is set. `id` is the
response's id; `request_id` the client's own x-request-id, where it sent one that is fit to echo
(record.echoable): a router's trace id finds its line.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import fields as dataclass_fields
from typing import Any

from aiohttp import web

from inferd.api.record import MAX_REQUEST_ID_CHARS, RECORD, REQUEST_ID_HEADER, RequestRecord, RequestTexts, echoable
from inferd.api.telemetry.request_file import REQUEST_JOURNAL

access_log = logging.getLogger("inferd.requests")

QUIET_PATHS = ("/health", "/ready", "/metrics", "/v1/status", "/v1/models", "/openapi.json")


def log_fields(request: web.Request, status: int, e2e: float, record: RequestRecord | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"path": request.path, "status": status, "e2e": round(e2e, 4)}
    if record is not None:
        values = {f.name: getattr(record, f.name) for f in dataclass_fields(record) if f.name != "texts"}
        values["class"] = values.pop("priority_class")
        values["finish"] = ",".join(sorted(set(record.finish))) or None
        for key in ("queue_time", "ttft"):
            if values[key] is not None:
                values[key] = round(values[key], 4)
        fields.update((k, v) for k, v in values.items() if v is not None)
    return fields


@web.middleware
async def access_log_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """One line per API request when it ends (the error middleware inside it has already
    turned errors into responses, so the status is the client's)."""
    if request.path in QUIET_PATHS:
        return await handler(request)
    start = time.monotonic()
    journal = request.app.get(REQUEST_JOURNAL)
    client_id = echoable(request.headers.get(REQUEST_ID_HEADER), MAX_REQUEST_ID_CHARS)  # (logged, echoed: app.py)
    request[RECORD] = RequestRecord(request_id=client_id, texts=None if journal is None else RequestTexts())
    status = 499  # the client left before an answer (the handler was cancelled)
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        e2e = time.monotonic() - start
        values = log_fields(request, status, e2e, request[RECORD])
        access_log.info("request %s", " ".join(f"{k}={v}" for k, v in values.items()), extra={"fields": values})
        if journal is not None:  # the request file's line, if it was a generation
            journal.finished(request[RECORD], request.path, status, e2e)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and a request's fields."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if fields is not None:
            payload.update(fields)
        else:
            payload["message"] = record.getMessage()
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, ensure_ascii=False)


def configure_logging(level: int, log_format: str) -> None:
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
