"""`inferd bench`'s HTTP side: one streamed request into a `RequestRecord`, the model list, and
inferd's counters from /metrics. Failures never raise out of here: they become a record's
error (a type and a message) or a `BenchError` with one clear line.

What a streamed response can end as (the record's error_type):

    200, token chunks ..., usage, [DONE]    ok
    200, ..., {"error": {...}}, [DONE]      the error's code or type (e.g. token_timeout)
    200, ..., connection closed             incomplete_stream (no [DONE])
    200, connection closed before an event  server_disconnected (nothing was generated)
    200, [DONE] with no token chunk         empty_stream
    4xx / 5xx                               the error body's code or type (else http_error)
    no response                             connection_error (refused), connection_reset,
                                            server_disconnected, timeout, client_error

`send` is one attempt; bench_retry sends again after the failures that are safe to repeat.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from inferd.client.bench_metrics import RequestRecord
from inferd.client.bench_workload import RequestSpec

USER_AGENT = "inferd-bench"


class BenchError(Exception):
    """The run cannot go on; the message is one clear line. `fatal`: every request would fail
    the same way (nobody there, the key refused)."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


def root_url(url: str) -> str:
    """The server's root from `host:port`, a base URL, or a URL ending in /v1."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url[: -len("/v1")] if url.endswith("/v1") else url


def headers(api_key: str | None) -> dict[str, str]:
    h = {"User-Agent": USER_AGENT}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def _error_fields(error: Any, status: int) -> tuple[str, str]:
    """(error type, message) from an `error` value: OpenAI's object, or some servers' string."""
    if isinstance(error, dict):
        kind = error.get("code") or error.get("type") or "http_error"
        return str(kind), f"HTTP {status}: {error.get('message') or kind}"
    return "http_error", f"HTTP {status}: {error}"


def _error_body(body: bytes, status: int) -> tuple[str, str]:
    """(error type, message) of a non-200 answer."""
    try:
        return _error_fields(json.loads(body)["error"], status)
    except Exception:  # noqa: BLE001 - any other body: the status line says enough
        text = body.decode("utf-8", "replace").strip().splitlines()
        return "http_error", f"HTTP {status}" + (f": {text[0][:200]}" if text else "")


def _os_reason(e: BaseException) -> str:
    """"Connection refused" rather than aiohttp's "Cannot connect to host ... [Connect call failed ...]"."""
    os_error = getattr(e, "os_error", e)
    if isinstance(os_error, OSError) and os_error.errno:
        return os.strerror(os_error.errno)
    return str(e) or type(e).__name__


def describe(record: RequestRecord, url: str, api_key: str | None) -> str:
    """The one line that explains a failure which will fail every request alike."""
    if record.error_type == "connection_error":
        return f"cannot reach {url}: {record.error} (is the server running there?)"
    if record.status in (401, 403):
        if not api_key:
            return f"{url} needs an API key ({record.error}): pass --api-key KEY"
        return f"{url} rejected the API key ({record.error})"
    return f"{url}: {record.error}"


def is_fatal(record: RequestRecord) -> bool:
    """A failure that every later request would share: nobody there, or the key is refused."""
    return record.error_type == "connection_error" or record.status in (401, 403)


# -------------------------------------------------------------------------------- the request


def request_body(spec: RequestSpec, model: str, *, chat: bool, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if chat:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    body |= {"max_tokens": spec.max_tokens, "temperature": 0.0, "stream": True,
             "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if spec.priority is not None:
        body["priority"] = spec.priority
    return body


def _answer_text(choice: dict[str, Any]) -> str:
    """The answer's own text in a choice: chat's `delta.content` (never the reasoning), or `text`."""
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def _token_text(choice: dict[str, Any]) -> str | None:
    """The text of a choice that carries a token, None for one that does not.

    Completions: `text`. Chat: `delta.content` (or `reasoning_content`). A chunk with empty text
    still carries a token (a detokenizer holding back a partial character) unless it is the
    chat role header or a bare finish chunk.
    """
    delta = choice.get("delta")
    if isinstance(delta, dict):
        text = delta.get("content")
        if not text and isinstance(delta.get("reasoning_content"), str):
            text = delta["reasoning_content"]
        header = "role" in delta
    else:
        text, header = choice.get("text"), False
    if not isinstance(text, str):
        return None
    if text or (not header and choice.get("finish_reason") is None):
        return text
    return None


class _Stream:
    """The SSE events of one response, read into its record as they arrive."""

    def __init__(self, record: RequestRecord, start: float) -> None:
        self.record = record
        self.start = start
        self.last: float | None = None  # when the last token-bearing chunk came
        self.events = 0  # `data:` lines read: none yet means nothing was generated
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None
        self.text: list[str] = []  # the answer's pieces, in order

    def line(self, raw: bytes, now: float) -> None:
        line = raw.strip()
        if not line.startswith(b"data:"):
            return  # ids, comments (keep-alives), blank lines between events
        data = line[len(b"data:"):].strip()
        self.events += 1
        if data == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.record.fail("bad_event", f"not JSON in the stream: {data[:100]!r}")
            return
        if not isinstance(event, dict):
            return
        if event.get("error") is not None:
            kind, message = _error_fields(event["error"], 200)
            self.record.fail(kind, message.replace("HTTP 200", "in the stream", 1))
            return
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        if isinstance(event.get("timings"), dict):  # llama-server's (its cache and draft counts)
            self.timings = event["timings"]
        choices = event.get("choices")
        if choices and isinstance(choices[0], dict) and _token_text(choices[0]) is not None:
            record = self.record
            if record.ttft is None:
                record.ttft = now - self.start
            else:
                assert self.last is not None
                record.itl.append(now - self.last)
            self.last = now
            record.chunks += 1
            self.text.append(_answer_text(choices[0]))

    def finish(self) -> None:
        record = self.record
        record.text = "".join(self.text)
        if self.last is not None:
            record.e2e = self.last - self.start
        usage = self.usage or {}
        if isinstance(usage.get("completion_tokens"), int):
            record.output_tokens, record.token_source = usage["completion_tokens"], "usage"
        else:
            record.output_tokens, record.token_source = record.chunks, "chunks"
        if isinstance(usage.get("prompt_tokens"), int):
            record.prompt_tokens = usage["prompt_tokens"]
        _cache_and_drafts(record, usage, self.timings or {})
        if not self.done:
            record.fail("incomplete_stream", "the server closed the stream before [DONE]")
        elif record.chunks == 0:
            record.fail("empty_stream", "the stream ended without a token")


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _cache_and_drafts(record: RequestRecord, usage: dict[str, Any], timings: dict[str, Any]) -> None:
    """Cached prompt tokens (OpenAI's usage.prompt_tokens_details.cached_tokens, else llama-server's
    timings.cache_n) and speculation's drafted / accepted tokens (inferd's usage.speculative, else
    llama-server's timings.draft_n / draft_n_accepted), where the server sends them."""
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    record.cached_tokens = cached if cached is not None else _count(timings.get("cache_n"))
    spec = usage.get("speculative")
    if isinstance(spec, dict) and _count(spec.get("drafted_tokens")) is not None:
        record.drafted_tokens, record.accepted_tokens = spec["drafted_tokens"], _count(spec.get("accepted_tokens"))
    elif _count(timings.get("draft_n")) is not None:
        record.drafted_tokens, record.accepted_tokens = timings["draft_n"], _count(timings.get("draft_n_accepted"))


async def send(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], record: RequestRecord, *,
    api_key: str | None, t0: float, clock: Callable[[], float] = time.perf_counter, start: float | None = None,
) -> RequestRecord:
    """POST a streaming request and fill `record` with its timings, tokens and any failure.

    `start`: when the request's first attempt was sent (a retry's times count from it)."""
    start = clock() if start is None else start
    record.send_time = start - t0
    stream = _Stream(record, start)
    try:
        async with session.post(url, json=body, headers=headers(api_key)) as response:
            record.status = response.status
            if response.status != 200:
                record.retry_after = response.headers.get("Retry-After")
                record.fail(*_error_body(await response.read(), response.status))
                return record
            await _read(response, stream, clock)
    except aiohttp.ClientConnectorError as e:
        record.fail("connection_error", _os_reason(e))
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as e:
        record.fail("timeout", f"no answer within the timeout ({type(e).__name__})")
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
        _dropped(stream, e)
    except Exception as e:  # noqa: BLE001 - whatever a server does, the run goes on and counts it
        record.fail("client_error", f"{type(e).__name__}: {e}")
    finally:
        record.elapsed = clock() - start
    return record


async def _read(response: aiohttp.ClientResponse, stream: _Stream, clock: Callable[[], float]) -> None:
    pending = b""
    async for data in response.content.iter_any():
        now = clock()  # NOTE: every event of one network read arrives at once, as in vLLM
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            stream.line(line, now)
    if pending:
        stream.line(pending, clock())
    stream.finish()


def _dropped(stream: _Stream, e: aiohttp.ClientError) -> None:
    """The connection lost: before the first event nothing was generated (safe to send again);
    after it, a stream cut short."""
    record = stream.record
    if stream.events:
        stream.finish()  # incomplete_stream unless [DONE] came first
    elif isinstance(e, aiohttp.ClientOSError):
        record.fail("connection_reset", f"the connection failed before the first event: {_os_reason(e)}")
    elif record.status is None:
        record.fail("server_disconnected", "the server closed the connection without answering")
    else:
        record.fail("server_disconnected", f"the server closed the connection after HTTP {record.status}, "
                    "before the first event")


# -------------------------------------------------------------------------------- the server


async def list_models(session: aiohttp.ClientSession, root: str, api_key: str | None) -> list[str]:
    """The model ids of GET /v1/models; BenchError with one line when there are none."""
    url = f"{root}/v1/models"
    probe = RequestRecord(index=-1)
    try:
        async with session.get(url, headers=headers(api_key)) as response:
            probe.status = response.status
            body = await response.read()
    except aiohttp.ClientConnectorError as e:
        probe.fail("connection_error", _os_reason(e))
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        probe.fail("client_error", f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    else:
        if probe.status != 200:
            probe.fail(*_error_body(body, probe.status))
    if not probe.ok:
        raise BenchError(describe(probe, url, api_key), fatal=is_fatal(probe))
    try:
        ids = [m["id"] for m in json.loads(body)["data"]]
    except Exception:  # noqa: BLE001 - any other shape
        ids = []
    if not ids:
        raise BenchError(f"{url} lists no models: pass --model NAME")
    return [str(i) for i in ids]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
COUNTERS = {  # report name: (Prometheus sample, the label that splits it, or None)
    "preemptions": ("inferd_preemptions_total", "mode"),
    "rejections": ("inferd_rejections_total", "reason"),
    "timeouts": ("inferd_timeouts_total", "kind"),
    "prefix_cache_hits": ("inferd_prefix_cache_hits_total", None),
    "prefix_cache_queries": ("inferd_prefix_cache_queries_total", None),
    "prompt_tokens": ("inferd_prompt_tokens_total", "class"),
    "generation_tokens": ("inferd_generation_tokens_total", "class"),
}


def parse_counters(text: str) -> dict[str, Any] | None:
    """inferd's counters from Prometheus text: {name: total} or {name: {label value: total}};
    None when the text has no inferd_ metrics (another server)."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or not match.group(1).startswith("inferd_"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        samples.setdefault(match.group(1), []).append((labels, value))
    if not samples:
        return None
    out: dict[str, Any] = {}
    for name, (sample, label) in COUNTERS.items():
        rows = samples.get(sample, [])
        if label is None:
            out[name] = sum(v for _, v in rows)
        else:
            split: dict[str, float] = {}
            for labels, v in rows:
                key = labels.get(label, "")
                split[key] = split.get(key, 0.0) + v
            out[name] = split
    return out


def counter_deltas(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """after − before, name by name (and label by label); a prefix-cache hit rate over the run."""
    if before is None or after is None:
        return None
    out: dict[str, Any] = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, dict):
            old = old if isinstance(old, dict) else {}
            out[name] = {k: _num(v - old.get(k, 0.0)) for k, v in value.items()}
        else:
            out[name] = _num(value - (old if isinstance(old, (int, float)) else 0.0))
    queries = out.get("prefix_cache_queries") or 0
    out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0) / queries if queries else None
    return out


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


async def read_counters(session: aiohttp.ClientSession, root: str, api_key: str | None) -> dict[str, Any] | None:
    """inferd's counters now, or None (not inferd, no /metrics, or not reachable)."""
    try:
        async with session.get(f"{root}/metrics", headers=headers(api_key)) as response:
            if response.status != 200:
                return None
            return parse_counters((await response.read()).decode("utf-8", "replace"))
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return None
