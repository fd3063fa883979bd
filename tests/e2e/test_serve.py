"""`inferd serve` as a real subprocess, driven over real sockets by the official `openai` client.

One server (the default bfloat16 path, batch-invariant, so greedy text does not depend on what
else runs; a 48-token step budget, so prefill is chunked) serves every test in this module.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from serveproc import Server, start_server, stop_server

from inferd.model.loading.loader import default_model_path
from inferd.text.tokenizer import Tokenizer
from inferd.text.tokenizer_loader import load_tokenizer

pytestmark = pytest.mark.served  # it starts a real server

MODEL = "smollm2"
STEP_BUDGET = 48


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("serve"),
        "--served-model-name", MODEL, "--kv-cache-memory", "256MiB",
        "--max-num-seqs", "128", "--max-num-batched-tokens", str(STEP_BUDGET),
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def kv_blocks_used(server: Server) -> int:
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/v1/status", timeout=10) as response:
        return json.load(response)["kv_blocks_used"]


def wait_for_empty_cache(server: Server, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    used = kv_blocks_used(server)
    while used and time.monotonic() < deadline:
        time.sleep(0.05)
        used = kv_blocks_used(server)
    return used


# ------------------------------------------------------------------------------------------


def test_completions_stream_equals_non_stream(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    prompt = "The three most important inventions in history are"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.9, seed=1234)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text and streamed
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.prompt_tokens == full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if full.choices[0].finish_reason == "length":
        assert full.usage.completion_tokens == 20


def test_chat_stream_equals_non_stream(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0.7, seed=99)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.role == "assistant"
    assert streamed == full.choices[0].message.content and streamed
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens == len(prompt_ids)
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]


def test_sse_framing_ids_and_done(server: Server) -> None:
    async def fetch() -> tuple[dict, str]:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True, "temperature": 0}
            async with session.post(f"{server.base_url}/completions", json=body) as response:
                return dict(response.headers), await response.text()

    headers, text = asyncio.run(fetch())
    assert headers["Content-Type"].startswith("text/event-stream")
    assert headers["Cache-Control"] == "no-cache" and headers["X-Accel-Buffering"] == "no"
    events = [e for e in text.split("\n\n") if e.strip() and not e.startswith(":")]
    assert events[-1] == "data: [DONE]"
    for number, event in enumerate(events[:-1]):
        lines = event.split("\n")
        assert lines[0].startswith("id: ") and lines[1].startswith("data: {")
        chunk = json.loads(lines[1][len("data: "):])
        assert lines[0] == f"id: {chunk['id']}:{number}"  # <response id>:<sequence number>


@pytest.mark.parametrize("streams", [pytest.param(64, marks=pytest.mark.soak), 12])
def test_concurrent_streams_equal_each_request_alone(client: openai.OpenAI, server: Server, streams: int) -> None:
    topics = ["cats", "the moon", "bread", "rain", "chess", "music", "trains", "glaciers"]
    requests = [
        (f"Write a sentence about {topics[i % 8]}." + " Please." * (i % 5), 3 + (i * 7) % 14) for i in range(streams)
    ]

    async def run_all() -> list[str]:
        async_client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)

        async def one(prompt: str, max_tokens: int) -> str:
            stream = await async_client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(p, m) for p, m in requests))
        finally:
            await async_client.close()

    concurrent = asyncio.run(run_all())
    for (prompt, max_tokens), text in zip(requests, concurrent):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert text == alone.choices[0].text, prompt
    assert wait_for_empty_cache(server) == 0


@pytest.mark.parametrize("streams", [pytest.param(100, marks=pytest.mark.soak), 20])
def test_closed_streams_return_every_kv_block(server: Server, streams: int) -> None:
    async def run() -> list[int]:
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> int:
                body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 24, "stream": True,
                        "temperature": 0.8, "seed": i, "ignore_eos": True}
                events = 0
                async with session.post(f"{server.base_url}/completions", json=body) as response:
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            events += 1
                            if i % 2 and events == 2:
                                return events  # leaves the block: the connection is closed mid-stream
                return events

            return await asyncio.gather(*(one(i) for i in range(streams)))

    counts = asyncio.run(run())
    assert all(counts[i] == 2 for i in range(1, streams, 2))
    assert all(counts[i] >= 24 for i in range(0, streams, 2))  # 24 tokens (+ a final chunk)
    assert wait_for_empty_cache(server) == 0


def prefill_beside_streams(server: Server, words: int, stream_tokens: int) -> tuple[list[list[float]], float, float]:
    """8 streams running (`stream_tokens` each), then one prompt of ~2 tokens a word prefilled
    beside them: each stream's token arrival times, and when the long request was sent and got its
    first token."""
    long_prompt = " ".join(f"word{i}" for i in range(words))

    async def run() -> tuple[list[list[float]], float, float]:
        async with aiohttp.ClientSession() as session:
            arrivals: list[list[float]] = [[] for _ in range(8)]
            started = asyncio.Event()

            async def stream(i: int) -> None:
                body = {"model": MODEL, "prompt": f"Count slowly, step {i}:", "max_tokens": stream_tokens, "stream": True,
                        "temperature": 0, "ignore_eos": True}
                async with session.post(f"{server.base_url}/completions", json=body) as response:
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            arrivals[i].append(time.monotonic())
                            if all(len(a) >= 10 for a in arrivals):
                                started.set()

            async def long_request() -> tuple[float, float]:
                await started.wait()
                t0 = time.monotonic()
                body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 1, "stream": True}
                async with session.post(f"{server.base_url}/completions", json=body) as response:
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            return t0, time.monotonic()
                return t0, time.monotonic()

            *_, (t0, t1) = await asyncio.gather(*(stream(i) for i in range(8)), long_request())
            return arrivals, t0, t1

    return asyncio.run(run())


def test_a_long_prompt_is_prefilled_in_chunks_between_the_running_streams_tokens(server: Server) -> None:
    """Order, not timing: a ~600-token prompt takes ~12 steps of 48 tokens, and every running
    stream gets tokens in between (chunked prefill never holds the decodes back)."""
    arrivals, t0, t1 = prefill_beside_streams(server, 300, 40)
    for times in arrivals:
        assert sum(t0 <= t <= t1 for t in times) >= 5, "the stream should keep flowing while the long prompt is prefilled"


@pytest.mark.measure
def test_long_prompt_prefill_does_not_stall_running_streams(server: Server) -> None:
    arrivals, t0, t1 = prefill_beside_streams(server, 1000, 120)  # ~2,000 tokens
    assert t1 - t0 > 1.0  # the prefill really took many steps
    for times in arrivals:
        gaps = [b - a for a, b in zip(times, times[1:])]
        during = [b - a for a, b in zip(times, times[1:]) if a >= t0 and b <= t1]
        assert len(during) >= 5, "the stream should keep flowing while the long prompt is prefilled"
        assert max(during) < 3 * statistics.median(gaps), (max(during), statistics.median(gaps))


@pytest.mark.parametrize(
    ("args", "env", "key"),
    [
        (["--block-size", "12"], {}, "cache.block_size"),
        (["--dtype", "fp8"], {}, "model.dtype"),
        ([], {"INFERD_SCHEDULER_MAX_NUM_SEQS": "0"}, "scheduler.max_num_seqs"),
        (["--preemption-mode", "drop"], {}, "scheduler.preemption_mode"),
        ([], {"INFERD_SCHEDULER_DEFAULT_CLASS": "vip"}, "default_class 'vip'"),
    ],
)
def test_invalid_settings_exit_before_binding(tmp_path: Path, args: list[str], env: dict[str, str], key: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "inferd.cli", "serve", "--port", "0", *args],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env={**os.environ, **env},
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("inferd: error:") and key in lines[0], proc.stderr
    assert "inferd serving" not in proc.stderr
