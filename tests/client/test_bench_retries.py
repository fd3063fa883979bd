"""`inferd bench --retries`: the backoff policy (seeded, exact bounds), what is retried, and the
retrying request against real aiohttp servers on real sockets: 503 with Retry-After, 429 without,
a connection closed before any answer or before the first event, a stream cut half-way (never
retried), a refused port; then the whole CLI with its summary and --json."""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import os
import random
import re
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from rich.console import Console

from inferd.client.bench import BenchConfig
from inferd.client.bench_metrics import RequestRecord, retry_cause, summarize
from inferd.client.bench_report import compare_rows, render_run
from inferd.client.bench_retry import RetryPolicy, parse_retry_after, send_retrying

BASE = 0.05  # seconds: small backoffs keep the tests fast
HITS = web.AppKey("hits", list)  # perf_counter() of each request the server got

# ------------------------------------------------------------------------------------ policy


def test_full_jitter_stays_within_its_bound() -> None:
    policy = RetryPolicy(retries=10, base=1.0, cap=30.0)
    assert [policy.bound(k) for k in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert policy.bound(10_000) == 30.0  # no overflow far out
    rng = random.Random(1234)
    for k in range(8):
        waits = [policy.delay(k, None, rng) for _ in range(2000)]
        bound = policy.bound(k)
        assert all(0.0 <= w <= bound for w in waits), k
        assert max(waits) > 0.95 * bound and min(waits) < 0.05 * bound  # the whole range: full jitter
        assert sum(waits) / len(waits) == pytest.approx(bound / 2, rel=0.05)
    again = [RetryPolicy(3, 0.5).delay(k, None, random.Random(7)) for k in range(3)]
    assert again == [RetryPolicy(3, 0.5).delay(k, None, random.Random(7)) for k in range(3)]


def test_retry_after_is_a_floor_and_capped() -> None:
    policy = RetryPolicy(retries=3, base=BASE, cap=30.0)
    rng = random.Random(0)
    for k in range(3):
        for _ in range(500):
            wait = policy.delay(k, 1.0, rng)
            assert 1.0 <= wait <= 1.0 + policy.bound(k)
    assert 30.0 <= policy.delay(0, 3600.0, rng) <= 30.0 + BASE  # a server asking for an hour: 30 s
    assert 0.0 <= policy.delay(0, 0.0, rng) <= BASE


def test_parse_retry_after() -> None:
    assert parse_retry_after("1") == 1.0 and parse_retry_after(" 120 ") == 120.0 and parse_retry_after("0") == 0.0
    for bad in (None, "", "soon", "-1", "1.5", "nan", "²"):
        assert parse_retry_after(bad) is None, bad
    now = datetime.datetime(2025, 1, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)
    assert parse_retry_after("Wed, 01 Jan 2025 12:00:05 GMT", now) == 5.0
    assert parse_retry_after("Wed, 01 Jan 2025 11:00:00 GMT", now) == 0.0  # already past


def test_what_is_retried() -> None:
    def failed(error_type: str, status: int | None) -> RequestRecord:
        return RequestRecord(index=0, status=status, error_type=error_type, error="x")

    assert retry_cause(RequestRecord(index=0, status=200)) is None
    assert retry_cause(failed("connection_error", None)) == "connection"
    assert retry_cause(failed("connection_reset", None)) == "connection"
    assert retry_cause(failed("server_disconnected", None)) == "connection"
    assert retry_cause(failed("server_disconnected", 200)) == "connection"  # closed before the first event
    assert retry_cause(failed("queue_full", 429)) == "429" and retry_cause(failed("http_error", 503)) == "503"
    assert retry_cause(failed("incomplete_stream", 200)) == "cut"  # sent again from the start
    for kind, status in (("timeout", None), ("http_error", 500), ("token_timeout", 200),
                         ("invalid_api_key", 401), ("client_error", None)):
        assert retry_cause(failed(kind, status)) is None, kind


def test_config_checks_the_options() -> None:
    assert BenchConfig("u").retry == RetryPolicy(0, 1.0)
    assert BenchConfig("u", retries=3, retry_base=0.1).to_json()["retries"] == 3
    for bad, option in ((dict(retries=-1), "--retries"), (dict(retries=101), "--retries"),
                        (dict(retry_base=0.0), "--retry-base"), (dict(retry_base=float("inf")), "--retry-base")):
        with pytest.raises(ValueError, match=option):
            BenchConfig("u", **bad).check()


# ------------------------------------------------------------------------------------ servers

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def event(text: str, finish: str | None = None) -> bytes:
    chunk = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}\n\n'


async def stream(request: web.Request, *, cut: bool = False) -> web.StreamResponse:
    """inferd's stream: token chunks, usage, [DONE]; `cut`: two chunks, then the connection dropped."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for text in ("Once", " upon") if cut else ("Once", " upon", " a"):
        await response.write(event(text))
        await asyncio.sleep(0.01)
    if cut:
        assert request.transport is not None
        request.transport.close()
        return response
    await response.write(USAGE + b"data: [DONE]\n\n")
    return response


async def refuse(request: web.Request, status: int, retry_after: str | None) -> web.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else None
    code = "queue_full" if status == 429 else "overloaded"
    return web.json_response({"error": {"message": "busy", "type": "server_error", "code": code}},
                             status=status, headers=headers)


async def close_before_answer(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.close()
    return web.Response()


async def close_after_headers(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b": keep-alive\n\n")  # a comment, no event: nothing generated yet
    await asyncio.sleep(0.01)
    assert request.transport is not None
    request.transport.close()
    return response


BEHAVIOURS: dict[str, Handler] = {
    "ok": stream,
    "half": lambda r: stream(r, cut=True),
    "503-ra1": lambda r: refuse(r, 503, "1"),
    "503": lambda r: refuse(r, 503, None),
    "429": lambda r: refuse(r, 429, None),
    "close": close_before_answer,
    "close-after-headers": close_after_headers,
}


def scripted(*script: str) -> web.Application:
    """A server that answers its n-th completion request as `script[n]` (the last one after that)."""
    application = web.Application()
    application[HITS] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        hits = request.app[HITS]
        hits.append(time.perf_counter())
        await request.read()
        return await BEHAVIOURS[script[min(len(hits), len(script)) - 1]](request)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    application.router.add_post("/v1/completions", completions)
    application.router.add_get("/v1/models", models)
    return application


async def post(root: str, retries: int, base: float = BASE) -> RequestRecord:
    connector = aiohttp.TCPConnector(force_close=True)  # as `inferd bench`: a fresh connection per request
    async with aiohttp.ClientSession(connector=connector) as session:
        return await send_retrying(session, f"{root}/v1/completions", {"prompt": "x", "stream": True},
                                   RequestRecord(index=3, priority="batch"), api_key=None, t0=time.perf_counter(),
                                   policy=RetryPolicy(retries, base), rng=random.Random(0))


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "INFERD_API_KEY"} | {"COLUMNS": "200"}


def gaps(hits: list[float]) -> list[float]:
    return [b - a for a, b in zip(hits, hits[1:])]


# ------------------------------------------------------------------------------------ one request


@pytest.mark.asyncio
async def test_503_retry_after_is_waited_then_the_stream_counts_from_the_first_send(serve: Any) -> None:
    app = scripted("503-ra1", "503-ra1", "ok")
    record = await post(await serve(app), retries=3)
    assert record.ok and record.attempts == 3 and record.retry_causes == ["503", "503"]
    assert (record.index, record.priority, record.output_tokens, record.chunks) == (3, "batch", 3, 3)
    waits = gaps(app[HITS])
    assert len(waits) == 2 and all(1.0 <= w < 1.0 + BASE * 2 + 0.25 for w in waits), waits
    assert 2.0 <= record.retry_wait < 2.5
    assert record.ttft is not None and record.e2e is not None
    assert record.ttft >= 2.0 and record.e2e >= record.ttft and record.elapsed >= record.e2e  # backoff included
    assert record.ttft + sum(record.itl) == pytest.approx(record.e2e)


@pytest.mark.asyncio
async def test_429_without_retry_after_backs_off_with_jitter(serve: Any) -> None:
    app = scripted("429", "429", "429", "ok")
    record = await post(await serve(app), retries=3)
    assert record.ok and record.attempts == 4 and record.retry_causes == ["429", "429", "429"]
    waits = gaps(app[HITS])
    assert all(w < BASE * 2**k + 0.2 for k, w in enumerate(waits)), waits
    assert record.retry_wait < sum(BASE * 2**k for k in range(3)) + 0.2


@pytest.mark.asyncio
async def test_exhausted_retries_keep_the_last_failure(serve: Any) -> None:
    app = scripted("503")
    record = await post(await serve(app), retries=2)
    assert not record.ok and record.status == 503 and record.error_type == "overloaded"
    assert record.attempts == 3 and record.retry_causes == ["503", "503"] and len(app[HITS]) == 3
    none = scripted("503")
    once = await post(await serve(none), retries=0)  # the default: today's behaviour, one attempt
    assert once.attempts == 1 and once.retry_causes == [] and once.retry_wait == 0.0 and len(none[HITS]) == 1


@pytest.mark.asyncio
async def test_connections_closed_before_the_first_event_are_retried(serve: Any) -> None:
    app = scripted("close", "close-after-headers", "ok")
    record = await post(await serve(app), retries=2)
    assert record.ok and record.attempts == 3 and record.retry_causes == ["connection", "connection"]
    assert len(app[HITS]) == 3 and record.output_tokens == 3
    dropped = scripted("close-after-headers")
    last = await post(await serve(dropped), retries=1)
    assert (last.status, last.error_type, last.attempts) == (200, "server_disconnected", 2)
    assert "before the first event" in (last.error or "")


@pytest.mark.asyncio
async def test_a_stream_cut_half_way_is_sent_again_and_only_the_last_attempt_counts(serve: Any) -> None:
    app = scripted("half", "ok")
    record = await post(await serve(app), retries=3)
    assert record.ok and record.attempts == 2 and record.retry_causes == ["cut"] and len(app[HITS]) == 2
    complete = await post(await serve(scripted("ok")), retries=0)
    assert (record.chunks, record.output_tokens) == (complete.chunks, complete.output_tokens)  # none twice
    cut = await post(await serve(scripted("half", "ok")), retries=0)
    assert not cut.ok and cut.error_type == "incomplete_stream" and cut.attempts == 1  # without --retries


@pytest.mark.asyncio
async def test_a_refused_port_is_retried_then_given_up() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    record = await post(f"http://127.0.0.1:{port}", retries=2)
    assert record.error_type == "connection_error" and record.error == "Connection refused"
    assert record.attempts == 3 and record.retry_causes == ["connection", "connection"]


# ------------------------------------------------------------------------------------ reports


def test_summary_report_and_compare_carry_the_retries() -> None:
    records = [
        RequestRecord(index=0, ttft=0.5, e2e=0.6, itl=[0.1], output_tokens=2, chunks=2, status=200,
                      attempts=2, retry_causes=["429"], retry_wait=0.4),
        RequestRecord(index=1, status=503, error_type="overloaded", error="HTTP 503: busy",
                      attempts=3, retry_causes=["connection", "503"], retry_wait=0.3),
        RequestRecord(index=2, status=200, error_type="incomplete_stream", error="cut", chunks=2),
        RequestRecord(index=3, status=500, error_type="http_error", error="HTTP 500", attempts=2,
                      retry_causes=["503"], retry_wait=0.1),  # retried, then a failure not retried
    ]
    r = summarize(records, duration=1.0)["retries"]
    assert r == {"total": 4, "by_cause": {"connection": 1, "429": 1, "503": 2, "cut": 0}, "requests_retried": 3,
                 "succeeded_after_retry": 1, "exhausted": 1,
                 "exhausted_by_cause": {"connection": 0, "429": 0, "503": 1, "cut": 0},
                 "wait_s": pytest.approx(0.8)}
    run = {"label": "c=1", "summary": summarize(records, duration=1.0), "server_counters": None}
    console = Console(record=True, width=200, color_system=None, file=io.StringIO())
    console.print(render_run(run))
    text = console.export_text()
    assert "retries  4 (connection 1, 429 1, 503 2) for 3 requests: 1 then completed, 1 gave up (503 1)" in text
    assert "0.80 s of backoff, counted in their TTFT and e2e" in text
    quiet = {"label": "c=1", "summary": summarize(records[2:3], duration=1.0), "server_counters": None}
    console.print(render_run(quiet))
    assert console.export_text().count("retries") == 0
    again = RequestRecord.from_json(json.loads(json.dumps(records[1].to_json())))
    assert (again.attempts, again.retry_causes, again.retry_wait) == (3, ["connection", "503"], 0.3)
    assert ("retries", None, 4, None) in compare_rows({}, run["summary"])


# ------------------------------------------------------------------------------------ the CLI


@pytest.mark.asyncio
async def test_cli_counts_retries_in_the_summary_and_json(serve: Any, tmp_path: Path) -> None:
    # concurrency 1, so requests take the script in order:
    #   r0: 429 → ok                      2 attempts, completed after a retry
    #   r1: close, close-after-headers → ok  3 attempts
    #   r2: half a stream → ok             2 attempts, sent again from the start
    #   r3: 503 × 3                        3 attempts, gave up (503)
    #   r4: ok
    app = scripted("429", "ok", "close", "close-after-headers", "ok", "half", "ok", "503", "503", "503", "ok")
    root = await serve(app)
    out = tmp_path / "retries.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "inferd.cli", "bench", root, "--num-requests", "5", "--retries", "2",
        "--retry-base", str(BASE), "--json", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=environment(),
    )
    stdout_b, stderr_b = await asyncio.wait_for(proc.communicate(), 60)
    stdout = stdout_b.decode()
    assert proc.returncode == 0, stdout + stderr_b.decode()
    assert len(app[HITS]) == 11
    assert "4 completed, 1 failed" in stdout
    assert re.search(r"retries  6 \(connection 2, 429 1, 503 2, cut 1\) for 4 requests: 3 then completed, "
                     r"1 gave up \(503 1\)", stdout), stdout
    data = json.loads(out.read_text())
    assert data["config"]["retries"] == 2 and data["config"]["retry_base"] == BASE
    [run] = data["runs"]
    assert [r["attempts"] for r in run["requests"]] == [2, 3, 2, 3, 1]
    assert [r["retry_causes"] for r in run["requests"]] == [["429"], ["connection", "connection"], ["cut"],
                                                            ["503", "503"], []]
    assert [r["error_type"] for r in run["requests"]] == [None, None, None, "overloaded", None]
    retries = run["summary"]["retries"]
    assert retries["total"] == 6 and retries["by_cause"] == {"connection": 2, "429": 1, "503": 2, "cut": 1}
    assert retries["succeeded_after_retry"] == 3 and retries["requests_retried"] == 4
    assert retries["exhausted"] == 1 and retries["exhausted_by_cause"] == {"connection": 0, "429": 0, "503": 1, "cut": 0}
    assert run["summary"]["errors"]["by_type"] == {"overloaded": 1}
