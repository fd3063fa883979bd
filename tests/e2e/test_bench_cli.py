"""`inferd bench` as a real subprocess: against a real `inferd serve` (one server with an API
key for the module: the good runs pass it), a closed port, and a stub that cuts streams short."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from serveproc import Server, start_server, stop_server

KEY = "secret"
SERVED = web.AppKey("served", list)  # [requests the stub answered]
BENCH = [sys.executable, "-m", "inferd.cli", "bench"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("bench"), "--kv-cache-memory", "64MiB", "--max-num-seqs", "8",
                       "--api-key", KEY)
    yield srv
    stop_server(srv)


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "INFERD_API_KEY"} | {"COLUMNS": "120"}


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=120, env=environment())


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------


@pytest.mark.served
def test_closed_loop_run_is_consistent(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = bench(server.url, "--concurrency", "4", "--num-requests", "20", "--input-len", "16", "--output-len", "8",
                   "--ignore-eos", "--api-key", KEY, "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "20 completed, 0 failed" in result.stdout and "TTFT" in result.stdout and "TPOT" in result.stdout
    data = json.loads(out.read_text())
    assert data["server"]["inferd"] is True and data["server"]["model"]
    assert "api_key" not in data["config"] and KEY not in out.read_text()
    [run] = data["runs"]
    requests = run["requests"]
    assert len(requests) == 20 and sorted(r["index"] for r in requests) == list(range(20))
    for r in requests:
        assert r["status"] == 200 and r["error_type"] is None, r
        assert 0 < r["ttft"] <= r["e2e"] <= r["elapsed"], r
        assert abs(r["ttft"] + sum(r["itl"]) - r["e2e"]) < 0.005, r
        assert r["token_source"] == "usage" and r["output_tokens"] == 8, r
        assert r["prompt_tokens"] > 0 and 7 <= r["chunks"] <= 8 and len(r["itl"]) == r["chunks"] - 1, r
    summary = run["summary"]
    assert summary["completed"] == 20 and summary["output_tokens"] == 160 and summary["token_source"] == "usage"
    assert summary["input_tokens"] == sum(r["prompt_tokens"] for r in requests)
    assert summary["output_throughput"] == pytest.approx(160 / summary["duration_s"])
    assert summary["ttft"]["p50"] <= summary["e2e"]["p50"] and summary["errors"]["total"] == 0
    counters = run["server_counters"]
    assert counters is not None
    assert {"preemptions", "rejections", "timeouts", "prefix_cache_hits", "prefix_cache_queries"} <= set(counters)
    assert sum(counters["generation_tokens"].values()) == 160  # the server saw what the client counted
    assert counters["prefix_cache_queries"] > 0


@pytest.mark.served
def test_chat_with_classes_and_plot(server: Server, tmp_path: Path) -> None:
    out, png = tmp_path / "chat.json", tmp_path / "chat.png"
    result = bench(server.url + "/v1", "--endpoint", "chat", "--concurrency", "2", "--num-requests", "6",
                   "--output-len", "4", "--ignore-eos", "--priority-mix", "interactive=0.5,batch=0.5",
                   "--slo", "ttft=30,tpot=30", "--api-key", KEY, "--json", str(out), "--plot", str(png))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert summary["completed"] == 6 and summary["output_tokens"] == 24 and summary["good_requests"] == 6
    assert set(summary["classes"]) == {"interactive", "batch"}
    assert sum(c["completed"] for c in summary["classes"].values()) == 6
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.served
def test_conversation_workload(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "conversation.json"
    result = bench(server.url, "--workload", "conversation", "--concurrency", "2", "--num-requests", "6",
                   "--turns", "3", "--system-tokens", "120", "--tool-tokens", "20-40", "--answer-tokens", "4-8",
                   "--ignore-eos", "--api-key", KEY, "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TTFT turn 1" in result.stdout and "TTFT turns 2+" in result.stdout
    [run] = json.loads(out.read_text())["runs"]
    requests = run["requests"]
    assert all(r["error_type"] is None and 4 <= r["output_tokens"] <= 8 for r in requests), requests
    for k in {r["conversation"] for r in requests}:  # each turn's prompt holds the last one's and more
        prompts = [r["prompt_tokens"] for r in sorted(requests, key=lambda r: r["turn"]) if r["conversation"] == k]
        assert prompts == sorted(set(prompts)), prompts
    summary = run["summary"]
    assert summary["completed"] == 6 and summary["conversations"]["started"] in (2, 3)
    assert summary["ttft_first_turn"]["p50"] is not None and summary["ttft_later_turns"]["p50"] is not None
    assert summary["prompt_tokens_later_turns_mean"] > min(r["prompt_tokens"] for r in requests)
    assert run["server_counters"]["prefix_cache_hits"] > 0  # the system prompt and earlier turns, shared


def test_unreachable_url_is_one_line_and_exit_1(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    result = bench(url, "--num-requests", "5", "--json", str(tmp_path / "r.json"))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach" in lines[0] and url in lines[0], result.stderr
    assert "Connection refused" in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert "connection_error" in result.stdout  # the summary counts it
    errors = json.loads((tmp_path / "r.json").read_text())["runs"][0]["summary"]["errors"]
    assert errors["by_type"] == {"connection_error": errors["total"]} and errors["total"] >= 1


@pytest.mark.served
def test_missing_or_wrong_key_is_one_line(server: Server) -> None:
    result = bench(server.url, "--num-requests", "3", "--output-len", "2")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "API key" in lines[0] and "--api-key" in lines[0], result.stderr
    assert "HTTP 401" in result.stdout and "Traceback" not in result.stdout + result.stderr
    wrong = bench(server.url, "--num-requests", "3", "--output-len", "2", "--api-key", "not-the-key")
    assert wrong.returncode == 1 and "rejected the API key" in wrong.stderr and "Traceback" not in wrong.stderr


async def _stub_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})


async def _stub_completions(request: web.Request) -> web.StreamResponse:
    """Two chunks, then the end of the body without [DONE] (even requests) or a cut connection."""
    request.app[SERVED][0] += 1
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for text in ("Once", " upon"):
        event = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await asyncio.sleep(0.01)
    if request.app[SERVED][0] % 2 and request.transport is not None:
        request.transport.close()
    return response


@pytest.mark.asyncio
async def test_streams_closed_early_are_counted(tmp_path: Path) -> None:
    application = web.Application()
    application[SERVED] = [0]
    application.router.add_get("/v1/models", _stub_models)
    application.router.add_post("/v1/completions", _stub_completions)
    runner = web.AppRunner(application)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    out = tmp_path / "stub.json"
    try:
        proc = await asyncio.create_subprocess_exec(
            *BENCH, f"http://127.0.0.1:{port}", "--concurrency", "2", "--num-requests", "6", "--json", str(out),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=environment(),
        )
        stdout_b, stderr_b = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await runner.cleanup()
    stdout, stderr = stdout_b.decode(), stderr_b.decode()
    assert proc.returncode == 1 and application[SERVED] == [6]
    assert "Traceback" not in stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "no request succeeded" in lines[0] and "incomplete_stream" in lines[0], stderr
    assert "incomplete_stream 6" in stdout
    data = json.loads(out.read_text())
    run = data["runs"][0]
    assert run["summary"]["errors"]["by_type"] == {"incomplete_stream": 6}
    assert run["summary"]["errors"]["by_status"] == {"200": 6}
    assert run["server_counters"] is None and data["server"]["inferd"] is False
    assert all(r["chunks"] == 2 and r["ttft"] is not None for r in run["requests"])
