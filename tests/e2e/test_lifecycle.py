"""The daemon's life as an operator sees it (real `inferd serve` subprocesses): graceful drain on
SIGTERM, a second signal cutting it short, and the systemd notify protocol in order. The last two
do not depend on the model: the default tier runs them on a tiny random Llama folder (a GGUF
load is seconds on two cores), the soak tier on the default model too."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from serveproc import Server, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
import tiny_models  # (tests/model's builders of tiny checkpoints)

pytestmark = pytest.mark.served  # it starts a real server

MODEL = "smollm2"
BODY = {"model": MODEL, "prompt": "Tell me about the sea.", "max_tokens": 64, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
TINY_POSITIONS = 8192  # (room for the long stream of the second-signal test)
MODELS = [pytest.param("gguf", marks=pytest.mark.soak), "tiny"]


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Server:
    return start_server(tmp_path, "--served-model-name", MODEL, "--kv-cache-memory", "64MiB", *args, env=env)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    vocab = tiny_models.train_sentencepiece(folder)
    tiny_models.tiny_llama(vocab, seed=1, max_position_embeddings=TINY_POSITIONS).save_pretrained(
        folder, safe_serialization=True)
    return folder


@pytest.fixture
def model_args(request: pytest.FixtureRequest, model: str) -> tuple[str, ...]:
    """The serve flags that choose the model: none for the default one."""
    return () if model == "gguf" else ("--model", str(request.getfixturevalue("tiny_llama")))


async def stream(session: aiohttp.ClientSession, url: str, started: asyncio.Event | None = None,
                 **extra: object) -> tuple[int, list[dict]]:
    """(tokens, the events) of one streamed completion (tokens: its final usage's; speculation may
    put several in one event)."""
    events = []
    async with session.post(f"{url}/v1/completions", json={**BODY, **extra}) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
                if started is not None:
                    started.set()
    usage = [e["usage"] for e in events if e.get("usage")]
    return (usage[-1]["completion_tokens"] if usage else 0), events


@pytest.mark.parametrize("streams", [pytest.param(16, marks=pytest.mark.soak), 4])
def test_sigterm_drains_every_stream_then_exits_0(tmp_path: Path, streams: int) -> None:
    server = serve(tmp_path, "--drain-seconds", "60", "--log-format", "json")

    async def scenario() -> tuple[list, int, dict, str]:
        async with aiohttp.ClientSession() as session:
            firsts = [asyncio.Event() for _ in range(streams)]
            running = [asyncio.ensure_future(stream(session, server.url, e)) for e in firsts]
            await asyncio.gather(*(e.wait() for e in firsts))  # all of them are producing tokens
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with session.get(f"{server.url}/ready") as r:
                ready_status = r.status
            async with session.post(f"{server.url}/v1/completions", json={**BODY, "stream": False}) as r:
                refused = (r.status, r.headers.get("Retry-After"), await r.json())
            results = await asyncio.gather(*running)
        return results, ready_status, refused[2], refused[1]

    start = time.monotonic()
    results, ready_status, refused, retry_after = asyncio.run(scenario())
    assert server.proc.wait(timeout=60) == 0, server.log.read_text()
    assert time.monotonic() - start < 60
    for tokens, events in results:  # every stream ran to its end
        assert tokens == 64 and events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
        assert not any("error" in e for e in events)
    assert ready_status == 503
    assert refused["error"]["code"] == "draining" and retry_after
    records = [json.loads(line) for line in server.log.read_text().splitlines() if line.startswith("{")]
    assert any("drain: every request finished" in r.get("message", "") for r in records)
    requests = [r for r in records if r["logger"] == "inferd.requests" and r["path"] == "/v1/completions"]
    assert sorted(r["status"] for r in requests) == [200] * streams + [503]  # the streams, and the refused one
    assert all(r["completion_tokens"] == 64 and r["finish"] == "length" for r in requests if r["status"] == 200)
    assert not any("Tell me about the sea" in json.dumps(r) for r in records)  # no prompt text


@pytest.mark.parametrize("model", MODELS)
def test_a_second_signal_ends_the_drain_at_once(tmp_path: Path, model_args: tuple[str, ...], model: str) -> None:
    server = serve(tmp_path, "--drain-seconds", "300", *model_args)
    # still running at the second signal: the tiny model's steps take a millisecond or so
    tokens = BODY["max_tokens"] if model == "gguf" else 4000  # ([limits] max_tokens_limit: 4096)

    async def scenario() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            started = asyncio.Event()
            long = asyncio.ensure_future(stream(session, server.url, started, max_tokens=tokens))
            await started.wait()
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            server.proc.send_signal(signal.SIGTERM)
            return (await long)[1]

    start = time.monotonic()
    events = asyncio.run(scenario())
    assert server.proc.wait(timeout=30) == 0
    assert time.monotonic() - start < 30
    assert events[-1]["error"]["type"] == "service_unavailable"  # told, not cut off silently
    assert "did not finish in time" in server.log.read_text()


@pytest.mark.parametrize("model", MODELS)
def test_systemd_notify_messages_arrive_in_order(tmp_path: Path, model_args: tuple[str, ...], model: str) -> None:
    sock_path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(sock_path))
    listener.settimeout(0.2)
    messages: list[str] = []

    def receive_until(pattern: str, within: float) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                messages.append(listener.recv(4096).decode())
            except TimeoutError:
                continue
            if pattern in messages[-1]:
                return
        raise AssertionError(f"no {pattern!r} in {messages}")

    env = {"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "1000000"}  # a ping every 0.5 s
    server = serve(tmp_path, *model_args, env=env)
    try:
        receive_until("READY=1", 120)
        receive_until("WATCHDOG=1", 10)
        server.proc.send_signal(signal.SIGTERM)
        receive_until("STOPPING=1", 10)
        assert server.proc.wait(timeout=30) == 0
    finally:
        listener.close()
        if server.proc.poll() is None:
            server.proc.kill()
    kinds = [m.split("=")[0] for m in messages]
    first = {kind: kinds.index(kind) for kind in ("STATUS", "READY", "WATCHDOG", "STOPPING")}
    assert first["STATUS"] < first["READY"] < first["WATCHDOG"] < first["STOPPING"], messages
    assert "loading" in messages[0] and "ready" in messages[kinds.index("READY")]
    assert "draining" in messages[kinds.index("STOPPING")]
