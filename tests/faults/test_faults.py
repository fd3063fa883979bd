"""Each injected fault with 32 greedy streams in flight: the requests it hits fail with a clear
error, the rest complete exactly as in a clean run, the KV pool is whole afterwards (checked as
each server closes), readiness goes 503 and back as docs/operations.md's "Faults" section says, and the
server never exits."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from apiserver import MODEL, Server, serve

from inferd.settings.config import Settings
from inferd.engine.config import EngineConfig
from inferd.engine.worker.faults import FaultInjector, flip_final_norm
from inferd.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

PROMPTS = [f"Story {i}: once upon a time" for i in range(32)]
MAX_TOKENS = 12


def body(prompt: str, max_tokens: int = MAX_TOKENS, stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


async def stream(server: Server, prompt: str, max_tokens: int = MAX_TOKENS,
                 first_token: asyncio.Event | None = None) -> tuple[str, dict[str, Any] | None, float]:
    """A streamed completion: its text, the error event that ended it (None: it completed), and
    the longest gap between two events in seconds."""
    text, error, gap = "", None, 0.0
    async with server.session.post("/v1/completions", json=body(prompt, max_tokens)) as r:
        assert r.status == 200
        last = time.monotonic()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
            else:
                text += event["choices"][0]["text"]
                if first_token is not None:
                    first_token.set()
    return text, error, gap


async def run_all(server: Server, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[tuple[str, Any, float]]:
    return list(await asyncio.gather(*(stream(server, p, max_tokens) for p in prompts)))


@pytest.fixture(scope="module")
def clean() -> dict[str, str]:
    """Each prompt's text in a clean run, filled by the first test that needs it."""
    return {}


async def clean_texts(llm: LLMEngine, clean: dict[str, str], max_tokens: int = MAX_TOKENS) -> dict[str, str]:
    key = f"{max_tokens}:"
    if not any(k.startswith(key) for k in clean):
        async with serve(llm) as server:
            for prompt, (text, error, _) in zip(PROMPTS, await run_all(server, PROMPTS, max_tokens)):
                assert error is None
                clean[key + prompt] = text
    return {p: clean[key + p] for p in PROMPTS}


async def wait_for(server: Server, path: str, status: int, within: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        code, reply = await server.get(path)
        if code == status:
            return reply
        assert time.monotonic() < deadline, (path, code, reply)
        await asyncio.sleep(0.05)


async def test_a_request_whose_own_processing_raises_fails_alone_with_an_internal_error(llm: LLMEngine, clean) -> None:
    expected = await clean_texts(llm, clean)
    llm.faults = FaultInjector(fail_marker="XYZZY")
    async with serve(llm) as server:
        results = await asyncio.gather(run_all(server, PROMPTS), stream(server, "XYZZY says hello"),
                                       server.post("/v1/completions", body("XYZZY again", stream=False)))
        streams, (text, error, _), (status, reply) = results
        assert error is not None and (error["type"], error["code"]) == ("server_error", "internal_error")
        assert "injected failure" in error["message"] and text == ""
        assert status == 500 and reply["error"]["code"] == "internal_error"
        assert {p: t for p, (t, e, _) in zip(PROMPTS, streams)} == expected
        assert all(e is None for _, e, _ in streams)
        assert await server.get("/ready") == (200, {"status": "ready"})
        assert server.engine.snapshot.step_failures.get("request") == 2 and server.engine.alive


async def test_a_forward_that_raises_fails_its_step_with_a_retryable_error_and_the_engine_serves_on(
        llm: LLMEngine, clean) -> None:
    expected = await clean_texts(llm, clean)
    llm.faults = FaultInjector()
    async with serve(llm) as server:
        started = [asyncio.Event() for _ in PROMPTS]
        streams = [asyncio.ensure_future(stream(server, p, 64, e)) for p, e in zip(PROMPTS, started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        llm.faults.forward_failures = 1  # the next step, with every stream in it
        hit = await asyncio.gather(*streams)
        assert all(e is not None and (e["code"], e["type"]) == ("engine_error", "service_unavailable") for _, e, _ in hit)
        assert server.engine.snapshot.consecutive_step_failures <= 1
        assert await server.get("/ready") == (200, {"status": "ready"})  # one failed step: still ready
        after = await run_all(server, PROMPTS)  # the engine serves on, unchanged
        assert {p: t for p, (t, e, _) in zip(PROMPTS, after)} == expected
        assert server.engine.snapshot.step_failures.get("forward") == 1 and server.engine.alive


async def test_failed_steps_in_a_row_turn_ready_then_health_503_and_both_come_back(llm: LLMEngine) -> None:
    # (a recovery long enough that the success below and the /health poll fit inside it on a slow machine)
    settings = Settings.model_validate({"health": {"recover_seconds": 3.0, "liveness_failures": 3},
                                        "cache": {"kv_cache_memory": "32MiB"}})
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig.from_settings(settings))  # its own recovery time
    async with serve(engine, settings) as server:
        engine.faults = FaultInjector(forward_failures=3)  # (armed once the start-up probe has run)
        status, reply = await server.post("/v1/completions", body("Hello", stream=False))
        assert status == 503 and reply["error"]["code"] == "engine_error"
        await wait_for(server, "/ready", 200)  # one failure is not "in a row"
        assert (await server.post("/v1/completions", body("Hello", stream=False)))[0] == 503
        not_ready = await wait_for(server, "/ready", 503)
        assert not_ready["reason"] == "the engine failed 2 steps in a row"
        assert (await server.get("/health"))[0] == 200  # below the liveness threshold
        assert (await server.post("/v1/completions", body("Hello", stream=False)))[0] == 503
        await wait_for(server, "/health", 503)  # 3 in a row: a supervisor would restart it
        status, reply = await server.post("/v1/completions", body("Hello", stream=False))
        assert status == 200 and reply["choices"][0]["finish_reason"] == "length"  # the fault is spent
        await wait_for(server, "/health", 200)
        assert (await server.get("/ready"))[0] == 503  # recovering: no flapping back at once
        await wait_for(server, "/ready", 200, within=8.0)
        assert server.engine.alive


async def test_an_out_of_memory_step_is_retried_smaller_and_every_request_completes_unchanged(
        llm: LLMEngine, clean) -> None:
    expected = await clean_texts(llm, clean)
    llm.faults = FaultInjector(oom_above_tokens=20)  # 32 decodes do not fit; 16 do
    async with serve(llm) as server:
        results = await run_all(server, PROMPTS)
        assert {p: t for p, (t, e, _) in zip(PROMPTS, results)} == expected
        assert all(e is None for _, e, _ in results)
        snapshot = server.engine.snapshot
        assert snapshot.step_failures.get("oom", 0) > 0 and snapshot.oom_events_last_minute > 0
        assert snapshot.token_budget < llm.config.scheduler.max_num_batched_tokens  # later steps start smaller
        assert snapshot.healthy and (await server.get("/ready"))[0] == 200
        async with server.session.get("/metrics") as r:
            text = await r.text()
        assert 'inferd_step_failures_total{kind="oom"}' in text and "inferd_token_budget" in text


async def test_a_request_that_does_not_fit_even_alone_fails_with_out_of_memory_and_the_rest_complete(
        llm: LLMEngine, clean) -> None:
    expected = await clean_texts(llm, clean)
    llm.faults = FaultInjector(oom_above_tokens=20)
    long_prompt = "Please summarise: " + "the quick brown fox jumps over the lazy dog " * 4  # > 20 tokens
    async with serve(llm) as server:
        streams, (text, error, _) = await asyncio.gather(run_all(server, PROMPTS), stream(server, long_prompt))
        assert error is not None and error["code"] == "out_of_memory" and text == ""
        assert {p: t for p, (t, e, _) in zip(PROMPTS, streams)} == expected
        assert server.engine.alive


async def test_a_stalled_step_delays_every_stream_but_all_complete_unchanged(llm: LLMEngine, clean) -> None:
    expected = await clean_texts(llm, clean)
    llm.faults = FaultInjector()
    async with serve(llm) as server:
        started = [asyncio.Event() for _ in PROMPTS]
        streams = [asyncio.ensure_future(stream(server, p, MAX_TOKENS, e)) for p, e in zip(PROMPTS, started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        llm.faults.stall_seconds, llm.faults.stall_steps = 1.5, 1
        health = asyncio.ensure_future(wait_for(server, "/health", 200))  # answered during the stall
        results = await asyncio.gather(*streams)
        await health
        assert {p: t for p, (t, e, _) in zip(PROMPTS, results)} == expected
        assert all(e is None for _, e, _ in results) and max(g for _, _, g in results) >= 1.4
        assert (await server.get("/ready"))[0] == 200 and server.engine.alive


async def test_corrupted_weights_fail_the_idle_probe_and_ready_turns_503_until_repaired(llm: LLMEngine) -> None:
    settings = Settings.model_validate({"server": {"probe_interval_seconds": 0.2}})
    async with serve(llm, settings) as server:
        llm.faults = FaultInjector(corrupt_weights=True)  # at the next step
        try:
            status, _ = await server.post("/v1/completions", body("Hello", stream=False))
            assert status == 200  # answered: the weights are wrong, nothing raised
            not_ready = await wait_for(server, "/ready", 503)
            assert "inference probe produced" in not_ready["reason"]
        finally:
            flip_final_norm(llm.model)  # repaired in place
        await wait_for(server, "/ready", 200)
        assert server.engine.alive
