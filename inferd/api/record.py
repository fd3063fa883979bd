"""The request's record: what each stage learns about one API request, for its log line and
the request file (telemetry/ writes them when the request ends).

The record is made by the access-log middleware (telemetry/access_log.py) before any handler
runs, and filled in as the request goes: the key's tenant (gateway), the model that answered
(pipeline), the class, tokens, timings and finish reasons (streaming). Plain data, so every
stage can write it without importing the stage that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from inferd.engine.protocol import EngineOutput


class RequestTexts:
    """One request's prompt and output texts, kept while it runs (only with the request file on)."""

    __slots__ = ("prompt", "_parts", "_finish")

    def __init__(self) -> None:
        self.prompt: str | None = None
        self._parts: dict[tuple[int, int], list[str]] = {}  # (group id, choice) -> text pieces
        self._finish: dict[tuple[int, int], str | None] = {}

    def add(self, out: EngineOutput) -> None:
        key = (out.group_id, out.index)
        parts = self._parts.setdefault(key, [])
        if out.text:
            parts.append(out.text)
        if out.finished:
            self._finish[key] = out.finish_reason

    def outputs(self) -> list[str]:
        """Each choice's text, in the API's choice order (prompt by prompt: group ids rise)."""
        return ["".join(parts) for _, parts in sorted(self._parts.items())]

    def finish_reasons(self) -> list[str | None]:
        """Each choice's finish reason, in the order of `outputs` (None: it did not finish)."""
        return [self._finish.get(key) for key in sorted(self._parts)]


@dataclass
class RequestRecord:
    """What the handlers learn about one API request, for its log line (filled as it runs)."""

    id: str | None = None
    request_id: str | None = None  # the client's own x-request-id (a sane one: echoable), else None
    model: str | None = None  # the model that answered (several models: routing/registry.py)
    revision: str | None = None  # and its revision
    task: str = "generate"  # "embed" (/v1/embeddings) or "score" (/v1/rerank, /v1/score): a pooling request
    priority_class: str | None = None
    tenant: str | None = None  # its configured name (never a key or a digest)
    user: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of which from the host tier
    cache_miss: str | None = None  # why the cache served no more (RequestMetrics.cache_miss); None: a hit
    volatile_blocks: int | None = None  # prompt blocks dropped as volatile (None: none)
    preemptions: int = 0
    drafted_tokens: int | None = None  # speculation: draft tokens verified (None: none drafted)
    accepted_tokens: int | None = None  # of which accepted
    queue_time: float | None = None  # the slowest of its prompts'
    ttft: float | None = None
    finish: list[str] = field(default_factory=list)  # each choice's finish reason
    prompt: str | None = None  # only with server.log_prompts
    texts: RequestTexts | None = None  # prompt and outputs, only for the request file


RECORD = web.RequestKey("request_record", RequestRecord)

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128


def echoable(value: str | None, max_chars: int) -> str | None:
    """`value` if it may go back to the client in a response header as it came: 1 to `max_chars`
    printable ASCII characters (no CR, LF or other control, nothing a proxy could re-split);
    else None, and nothing is echoed."""
    if value and len(value) <= max_chars and all(" " <= c <= "~" for c in value):
        return value
    return None


def request_id(record: RequestRecord | None) -> str | None:
    """The id a response names its request by (x-request-id): the client's own, else the id
    inferd gave it (a generation's or pooling request's response id; None before one is made)."""
    if record is None:
        return None
    return record.request_id or record.id
