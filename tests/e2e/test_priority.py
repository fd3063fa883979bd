"""Priority classes protect interactive latency under a saturating batch load (real `inferd
serve` subprocess, real model, real sockets).

24 closed-loop batch streams keep every one of the engine's 8 seats busy and 16 requests
queued; a trickle of short interactive requests arrives on top. With classes, an interactive
request takes a seat from a batch request at once (preemption at max_num_seqs), so its TTFT is
its unloaded TTFT plus about two loaded steps. With a single class, the same request queues
behind the batch backlog (first come, first served), as in servers without priorities.
Load shedding is off here: this is the scheduler's own doing (shedding has unit tests).
The measure tier's (timing under load); tests/api/admission/test_scheduling.py has its order in the default one.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import aiohttp
import pytest
from serveproc import Server, start_server, stop_server

pytestmark = pytest.mark.served  # it starts a real server

MODEL = "smollm2"
SEATS = 8
BATCH_STREAMS = 24
INTERACTIVE_REQUESTS = 30
INTERACTIVE_GAP = 0.4  # seconds between interactive arrivals

COMMON = """
[scheduler]
max_num_seqs = {seats}
max_num_batched_tokens = 256
aging_seconds = 0
default_class = "{default}"
[shedding]
enabled = false
"""
CLASSES = """
[classes.interactive]
priority = 0
ttft_target = 1.0
[classes.batch]
priority = 1
"""
SINGLE = """
[classes.default]
priority = 0
ttft_target = 1.0
"""

BATCH_PROMPT = "Write a detailed essay about the history of bridges, their engineering and their builders. " * 3
INTERACTIVE_PROMPT = "What is the capital of France?"


def write_config(tmp_path: Path, classes: bool) -> Path:
    path = tmp_path / ("classes.toml" if classes else "single.toml")
    default = "interactive" if classes else "default"
    path.write_text(COMMON.format(seats=SEATS, default=default) + (CLASSES if classes else SINGLE))
    return path


def body(prompt: str, max_tokens: int, priority: str | None) -> dict:
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": True, "stream": True}
    if priority is not None:
        payload["priority"] = priority
    return payload


async def timed_stream(session: aiohttp.ClientSession, url: str, payload: dict) -> tuple[float, list[float]]:
    """(TTFT, token times) of one streamed completion, measured by the client."""
    start = time.perf_counter()
    times: list[float] = []
    async with session.post(f"{url}/v1/completions", json=payload) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                times.append(time.perf_counter() - start)
    return times[0], times


async def load_run(url: str, classes: bool) -> dict[str, float]:
    """Batch streams in a closed loop plus the interactive trickle; the client's numbers."""
    batch_priority = "batch" if classes else None
    inter_priority = "interactive" if classes else None
    stop = asyncio.Event()
    batch_itls: list[float] = []

    batch_tokens: list[float] = []  # arrival times of every batch token

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def batch_worker() -> None:
            while not stop.is_set():
                start = time.perf_counter()
                _, times = await timed_stream(session, url, body(BATCH_PROMPT, 48, batch_priority))
                batch_itls.extend(b - a for a, b in zip(times, times[1:]))
                batch_tokens.extend(start + t for t in times)

        workers = [asyncio.ensure_future(batch_worker()) for _ in range(BATCH_STREAMS)]
        await asyncio.sleep(3.0)  # every seat busy, a backlog queued
        pending = []
        trickle_start = time.perf_counter()
        for _ in range(INTERACTIVE_REQUESTS):
            pending.append(asyncio.ensure_future(
                timed_stream(session, url, body(INTERACTIVE_PROMPT, 4, inter_priority))))
            await asyncio.sleep(INTERACTIVE_GAP)
        ttfts = [ttft for ttft, _ in await asyncio.gather(*pending)]
        trickle_end = time.perf_counter()
        stop.set()
        await asyncio.gather(*workers)
    ttfts.sort()
    print("TTFTs", " ".join(f"{t:.3f}" for t in ttfts))
    return {
        "ttft_p95": ttfts[int(0.95 * len(ttfts)) - 1],
        "ttft_p50": statistics.median(ttfts),
        "step": statistics.median(batch_itls),
        # batch tokens per second while the interactive requests ran
        "batch_rate": sum(trickle_start <= t <= trickle_end for t in batch_tokens) / (trickle_end - trickle_start),
    }


async def unloaded_ttft(url: str) -> float:
    async with aiohttp.ClientSession() as session:
        await timed_stream(session, url, body(INTERACTIVE_PROMPT, 4, None))  # warm-up
        ttfts = [(await timed_stream(session, url, body(INTERACTIVE_PROMPT, 4, None)))[0] for _ in range(5)]
    return statistics.median(ttfts)


async def idle_status(server: Server) -> dict:
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            async with session.get(f"{server.url}/v1/status") as r:
                status = await r.json()
            if status["running"] == status["waiting"] == status["kv_blocks_used"] == 0:
                return status
            await asyncio.sleep(0.1)
    raise AssertionError(status)


def serve(tmp_path: Path, classes: bool) -> Server:
    return start_server(tmp_path, "--config", str(write_config(tmp_path, classes)), "--dtype", "bfloat16",
                        "--served-model-name", MODEL, "--kv-cache-memory", "256MiB")


@pytest.mark.measure
def test_interactive_ttft_holds_under_a_saturating_batch_load(tmp_path: Path) -> None:
    server = serve(tmp_path, classes=True)
    try:
        unloaded = asyncio.run(unloaded_ttft(server.url))
        with_classes = asyncio.run(load_run(server.url, classes=True))
        status = asyncio.run(idle_status(server))
    finally:
        stop_server(server)
    server = serve(tmp_path, classes=False)
    try:
        single = asyncio.run(load_run(server.url, classes=False))
    finally:
        stop_server(server)

    target = unloaded + 2 * with_classes["step"]
    print(f"\nunloaded TTFT {unloaded:.3f} s, loaded step {with_classes['step']:.3f} s, target {target:.3f} s")
    print(f"interactive p95 TTFT with classes {with_classes['ttft_p95']:.3f} s "
          f"(p50 {with_classes['ttft_p50']:.3f}), batch {with_classes['batch_rate']:.0f} tok/s")
    print(f"interactive p95 TTFT, one class   {single['ttft_p95']:.3f} s "
          f"(p50 {single['ttft_p50']:.3f}), batch {single['batch_rate']:.0f} tok/s")
    assert with_classes["ttft_p95"] <= target, (with_classes, unloaded)
    assert with_classes["batch_rate"] >= 0.5 * single["batch_rate"]  # batch kept going meanwhile
    assert single["ttft_p95"] > 3 * target, single  # the same load without classes misses far
    assert status["preemptions"].get("recompute", 0) > 0  # seats were taken from batch requests
