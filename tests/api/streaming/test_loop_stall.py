"""Nothing a request sends can stall the event loop: while an 8 MB completion prompt and a
1 MB chat message are refused, a healthy stream's chunks keep coming and /health answers at
once (the measure tier times it: gaps <= 0.25 s, /health <= 0.1 s); the default tier checks the
same requests are refused as they should be, from their size alone (no tokenizing), and that
the event loop's lag is in /metrics and /v1/status."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from apiserver import MODEL, Server, assert_error

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

# (encoded once: the test's client shares the server's event loop, and should not stall it itself)
BIG_PROMPT = json.dumps({"model": MODEL, "prompt": "word " * (8 * 2**20 // 5), "max_tokens": 4}).encode()  # 8 MB
BIG_MESSAGE = json.dumps({"model": MODEL, "max_tokens": 4, "messages": [
    {"role": "user", "content": "word " * (2**20 // 5)}]}).encode()  # 1 MB


async def refuse_both(server: Server) -> None:
    for path, data in (("/v1/completions", BIG_PROMPT), ("/v1/chat/completions", BIG_MESSAGE)):
        async with server.session.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
            body = await r.json()
        assert_error(r.status, body, 400, code="context_length_exceeded")
        assert "bytes" in body["error"]["message"]  # refused from its size, before any tokenizing


async def test_big_prompts_are_refused_and_the_lag_is_measured(server: Server) -> None:
    await refuse_both(server)
    deadline = time.perf_counter() + 2.0
    while True:  # (the lag timer ticks every 50 ms: on a quiet machine both refusals come sooner)
        async with server.session.get("/metrics") as r:
            text = await r.text()
        count = next(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("inferd_event_loop_lag_seconds_count"))
        if count > 0 or time.perf_counter() > deadline:
            break
        await asyncio.sleep(0.05)
    assert count > 0
    _, status = await server.get("/v1/status")
    assert status["event_loop_lag_seconds"] >= 0


@pytest.mark.measure
async def test_a_healthy_stream_and_health_go_on_while_big_prompts_are_refused(server: Server) -> None:
    gaps: list[float] = []
    health: list[float] = []
    body = {"model": MODEL, "prompt": "Count to a hundred:", "max_tokens": 80, "temperature": 0,
            "ignore_eos": True, "stream": True}

    async def healthy_stream() -> None:
        last = None
        async with server.session.post("/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    async def poll_health(until: asyncio.Future[None]) -> None:
        while not until.done():
            started = time.perf_counter()
            status, _ = await server.get("/health")
            health.append(time.perf_counter() - started)
            assert status == 200
            await asyncio.sleep(0.05)

    stream = asyncio.ensure_future(healthy_stream())
    await asyncio.sleep(1.0)  # its first tokens out: the gaps from here on are steady decode steps
    polling = asyncio.ensure_future(poll_health(stream))
    for _ in range(2):
        await refuse_both(server)
    await stream
    await polling
    _, status = await server.get("/v1/status")
    print(f"\nlargest gap {max(gaps) * 1000:.0f} ms (median {sorted(gaps)[len(gaps) // 2] * 1000:.0f}) over "
          f"{len(gaps)} chunks; /health worst {max(health) * 1000:.0f} ms over {len(health)} polls; the event "
          f"loop's worst lag {status['event_loop_lag_seconds'] * 1000:.0f} ms")
    assert max(gaps) <= 0.25, sorted(gaps)[-5:]
    assert max(health) <= 0.1, sorted(health)[-5:]
