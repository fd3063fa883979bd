"""The request file: one JSON line per finished generation request (the data-flywheel record),
and the drift statistics fed from the same records. Off unless `request_log.path` is set.

    {"time": "2025-01-02T03:04:05.678Z", "id": "chatcmpl-3f..", "tenant": "acme", "user": null,
     "class": "interactive", "model": "smollm2", "path": "/v1/chat/completions", "status": 200,
     "prompt_tokens": 31, "completion_tokens": 64, "finish_reasons": ["stop"], "queue_time": 0.004,
     "ttft": 0.081, "e2e": 2.31, "prompt": "... [email] ...", "outputs": ["..."]}

Who writes what: the stages fill the request's `RequestRecord` (api/record.py), its `texts` only when
this file is on (`Generation.note` adds each output's text); the access-log middleware hands the
record to `RequestJournal.finished` when the request ends, on the event loop. There the drift
monitor counts it (drift.py) and the line goes into a queue; a `QueueListener` thread redacts,
encodes and writes it through a `RotatingFileHandler`, so the loop never touches the file.

Which requests: those that reached the engine and ended with an answer, an engine outcome (a
timeout, an abort, a failure) or a client that left mid-stream; a refused request (4xx, or a
429 / 503 from the door) is not a generation and is not written.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import time
from collections.abc import AsyncIterator, Mapping
from logging.handlers import QueueListener, RotatingFileHandler
from pathlib import Path
from typing import Any

from aiohttp import web

from inferd.api.record import RequestRecord
from inferd.api.telemetry.drift import DriftMonitor, Observation, RefusalMatcher, script_shares
from inferd.settings.config import RequestLogSettings

log = logging.getLogger(__name__)


class Redactor:
    """Every match of a pattern replaced by its tag: "mail me at a@b.io" -> "mail me at [email]"."""

    def __init__(self, patterns: Mapping[str, str]) -> None:
        self._patterns = [(re.compile(pattern), f"[{tag}]") for tag, pattern in patterns.items()]

    def __call__(self, text: str) -> str:
        for pattern, tag in self._patterns:
            text = pattern.sub(tag, text)
        return text


class _LineFormatter(logging.Formatter):
    """A record's line as JSON, its texts redacted (on the writer thread)."""

    def __init__(self, redact: Redactor | None) -> None:
        super().__init__()
        self._redact = redact

    def format(self, record: logging.LogRecord) -> str:
        cached = getattr(record, "json_line", None)
        if cached is not None:  # (the rotating handler formats once to size it, once to write it)
            return cached
        line: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                                + f".{int(record.msecs):03d}Z", **record.line}  # type: ignore[attr-defined]
        if self._redact is not None:
            if line["prompt"] is not None:
                line["prompt"] = self._redact(line["prompt"])
            line["outputs"] = [self._redact(text) for text in line["outputs"]]
        record.json_line = json.dumps(line, ensure_ascii=False)
        return record.json_line


class RequestJournal:
    """The request file's writer thread and the drift monitor; `finished` per request (event loop)."""

    def __init__(self, settings: RequestLogSettings, model: str) -> None:
        assert settings.path is not None
        self.model = model
        self.drift = DriftMonitor(settings.drift_window_seconds, settings.baseline_requests)
        self._refusal = RefusalMatcher(settings.refusal_phrases)
        Path(settings.path).parent.mkdir(parents=True, exist_ok=True)
        # NOTE: opened now (not delayed), so an unwritable path stops the server at start
        self._handler = RotatingFileHandler(settings.path, maxBytes=settings.max_bytes,
                                            backupCount=settings.backups, encoding="utf-8")
        self._handler.setFormatter(_LineFormatter(Redactor(settings.redact_patterns) if settings.redact else None))
        self._queue: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        self._listener = QueueListener(self._queue, self._handler)

    def start(self) -> None:
        self._listener.start()

    def stop(self) -> None:
        """Write what is queued, then close the file."""
        self._listener.stop()
        self._handler.close()

    def finished(self, record: RequestRecord, path: str, status: int, e2e: float) -> None:
        try:
            self._finished(record, path, status, e2e)
        except Exception:  # noqa: BLE001 - the request's answer is out: never fail it for its log line
            log.exception("the request file's line of %s failed", record.id)

    def _finished(self, record: RequestRecord, path: str, status: int, e2e: float) -> None:
        texts = record.texts
        if texts is None or record.id is None or (status >= 400 and not record.finish):
            return  # not a generation: refused, or a client gone before any output
        outputs = texts.outputs()
        if record.task == "generate":  # (pooling requests have no answer text to drift)
            self.drift.observe(Observation(
                prompt_tokens=record.prompt_tokens, completion_tokens=record.completion_tokens,
                finish_reasons=tuple(record.finish), refusals=sum(map(self._refusal, outputs)),
                languages=script_shares(texts.prompt or "")))
        line = {"id": record.id, "tenant": record.tenant, "user": record.user, "class": record.priority_class,
                "model": record.model or self.model, "revision": record.revision, "path": path, "status": status,
                "task": record.task, "prompt_tokens": record.prompt_tokens,
                "completion_tokens": record.completion_tokens, "cached_tokens": record.cached_tokens,
                "host_cached_tokens": record.host_cached_tokens, "cache_miss": record.cache_miss,
                "finish_reasons": texts.finish_reasons(), "queue_time": _round(record.queue_time),
                "ttft": _round(record.ttft), "e2e": _round(e2e), "prompt": texts.prompt, "outputs": outputs}
        self._queue.put_nowait(logging.makeLogRecord({"msg": "request", "line": line}))


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


REQUEST_JOURNAL = web.AppKey("request_journal", RequestJournal)


def setup_request_file(app: web.Application, settings: RequestLogSettings, model: str) -> None:
    """With `settings.path` set: the journal under REQUEST_JOURNAL, its writer thread running
    while the app does."""
    if settings.path is None:
        return
    app[REQUEST_JOURNAL] = RequestJournal(settings, model)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        journal = app[REQUEST_JOURNAL]
        journal.start()
        yield
        journal.stop()

    app.cleanup_ctx.append(lifecycle)
