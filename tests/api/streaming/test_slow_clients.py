"""Slow clients over real sockets: clients that never read are paused, then cut, their KV blocks
freed and counted, while normal streams run on beside them.

A client that never reads is found once its buffers are full (its receive window, the socket's
send buffer and the transport's, ~50 token events here); until then its request runs like any
other. While it is paused, normal streams run as fast as alone: that is checked (the measure tier,
20 slow clients cut after 6 s). From its arrival (its first tokens included) the normal streams'
p99 ITL is printed. The default tier's twin: 4 slow clients cut after 1 s, paused, cut and freed
in that order, without the timing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from apiserver import MODEL, Server, serve

from inferd.settings.config import Settings
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.served  # it starts a real server

SLOW = 20
NORMAL = 4
SLOW_SECONDS = 6.0
TOKENS = 32  # per normal stream


def engine(llm: LLMEngine) -> LLMEngine:
    config = EngineConfig.of(kv_cache_memory=256 * 2**20, max_num_seqs=SLOW + NORMAL)
    return LLMEngine(llm.model, llm.tokenizer, config)


def settings(slow_seconds: float = SLOW_SECONDS) -> Settings:
    return Settings.model_validate({"server": {"slow_client_seconds": slow_seconds,
                                               "stream_send_buffer_bytes": 4096},
                                    "limits": {"max_tokens_limit": 4096}})


async def never_read(server: Server) -> socket.socket:
    """A client with a small receive window that sends a 3,000-token stream request and never reads."""
    body = json.dumps({"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 3000,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (server.test_server.host, server.test_server.port))
    await loop.sock_sendall(sock, head + body)
    return sock


async def itls(server: Server, tokens: int) -> list[float]:
    """One normal stream's gaps between token events."""
    body = {"model": MODEL, "prompt": "Count to one hundred:", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = []
    async with server.session.post("/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


async def metric(server: Server, name: str) -> float:
    async with server.session.get("/metrics") as r:
        text = await r.text()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


async def wait_for(server: Server, name: str, value: float, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while await metric(server, name) < value:
        assert time.monotonic() < deadline, (name, await server.get("/v1/status"))
        await asyncio.sleep(0.05)


async def normal_traffic(server: Server) -> list[float]:
    return [gap for gaps in await asyncio.gather(*(itls(server, TOKENS) for _ in range(NORMAL))) for gap in gaps]


async def pause_then_cut(server: Server, slow_clients: int, timed: bool) -> tuple[list[float], ...]:
    """Slow clients arrive (beside normal streams when `timed`): each is paused, then cut, and its
    blocks come back (asserted). `timed`: also the normal streams' gaps alone, as the slow ones
    arrive and while they are paused, and how many tokens each slow one generated before its pause."""
    if timed:
        await normal_traffic(server)  # (the first steps of a fresh engine are slower)
    alone = await normal_traffic(server) if timed else []
    slow = [await never_read(server) for _ in range(slow_clients)]
    try:
        arriving = await normal_traffic(server) if timed else []  # beside the slow ones' first tokens
        await wait_for(server, "inferd_slow_client_pauses_total", slow_clients)
        _, status = await server.get("/v1/status")
        normal_tokens = 3 * NORMAL * TOKENS if timed else 0
        tokens_before_pause = (status["classes"][0]["generation_tokens"] - normal_tokens) / slow_clients
        paused = await normal_traffic(server) if timed else []  # while all of them are paused
        assert await metric(server, "inferd_slow_client_cuts_total") == 0, "cut before the check ran"
        await wait_for(server, "inferd_slow_client_cuts_total", slow_clients)
        for _ in range(100):  # the cut requests' blocks are back at the engine's next step
            _, status = await server.get("/v1/status")
            if status["running"] == status["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.05)
        assert status["running"] == status["kv_blocks_used"] == 0, status
        # each cut request had generated a small part of its 3,000 tokens: the pause stopped it
        assert status["classes"][0]["generation_tokens"] < slow_clients * 3000 / 10
    finally:
        for sock in slow:
            sock.close()
    return alone, arriving, paused, [tokens_before_pause]


@pytest.mark.asyncio
async def test_clients_that_never_read_are_paused_then_cut_and_their_blocks_return(llm: LLMEngine) -> None:
    async with serve(engine(llm), settings(slow_seconds=2.0)) as server:
        await pause_then_cut(server, 4, timed=False)


@pytest.mark.asyncio
@pytest.mark.measure
async def test_normal_streams_run_as_fast_as_alone_beside_paused_clients(llm: LLMEngine) -> None:
    async with serve(engine(llm), settings()) as server:
        alone, arriving, paused, [tokens_before_pause] = await pause_then_cut(server, SLOW, timed=True)
    print(f"normal streams' p99 ITL: alone {p99(alone) * 1e3:.1f} ms; beside {SLOW} slow clients from their "
          f"arrival {p99(arriving) * 1e3:.1f} ms ({p99(arriving) / p99(alone):.2f}x), while they are paused "
          f"{p99(paused) * 1e3:.1f} ms ({p99(paused) / p99(alone):.2f}x); each slow one paused after "
          f"{tokens_before_pause:.0f} tokens")
    assert p99(paused) <= 1.5 * p99(alone), (p99(paused), p99(alone))
