"""Scheduling over HTTP on the real default model: priority classes by name and number, the
door's bounded queues (429 with Retry-After, atomic under a burst), draining (503), and
timeouts that end a request with finish_reason "timeout" and an error event naming them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from apiserver import MODEL, Server, assert_error, data_events, serve

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.settings.policy import DEFAULT_CLASSES, SchedulingPolicy, ShedConfig

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

COMPLETIONS = "/v1/completions"
GREEDY = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
# holds the one seat ~1 s on a fast CPU (~10 ms a token), long enough for a burst to meet it
LONG = {**GREEDY, "prompt": "Write a long story.", "max_tokens": 100}


def one_seat_engine(llm: LLMEngine, **interactive: Any) -> LLMEngine:
    """An engine over the session's model that runs one sequence at a time (so requests
    queue), with the built-in classes and the interactive one changed as given."""
    inter, batch = DEFAULT_CLASSES
    policy = SchedulingPolicy(classes=(dataclasses.replace(inter, **interactive), batch))
    config = EngineConfig.of(kv_cache_memory=16 * 2**20, max_num_seqs=1, policy=policy)
    return LLMEngine(llm.model, llm.tokenizer, config)


@pytest_asyncio.fixture
async def one_seat(llm: LLMEngine) -> AsyncIterator[Server]:
    async with serve(one_seat_engine(llm, max_waiting=3, max_tokens=500)) as s:
        yield s


async def wait_idle(server: Server) -> dict[str, Any]:
    for _ in range(200):
        status, body = await server.get("/v1/status")
        if body["kv_blocks_used"] == body["running"] == body["waiting"] == 0:
            return body
        await asyncio.sleep(0.02)
    raise AssertionError(body)


async def stream_events(server: Server, body: dict[str, Any]) -> tuple[int, list[str]]:
    response, events = await server.stream(COMPLETIONS, body)
    return response.status, events


# ------------------------------------------------------------------------------- classes


async def test_priority_by_name_or_number_and_unknown_ones(server: Server) -> None:
    for priority in ("interactive", "batch", 0, 1):
        status, body = await server.post(COMPLETIONS, {**GREEDY, "prompt": "Hi", "priority": priority})
        assert status == 200, body
    _, status_body = await server.get("/v1/status")
    assert [c["finished"].get("length", 0) >= 2 for c in status_body["classes"]] == [True, True]
    for priority in ("vip", 7):
        status, body = await server.post(COMPLETIONS, {**GREEDY, "prompt": "Hi", "priority": priority})
        assert_error(status, body, 400, param="priority", code="unknown_priority")
        assert "'interactive' (0), 'batch' (1)" in body["error"]["message"]
    for bad in (True, 1.5, ["batch"]):
        assert_error(*await server.post(COMPLETIONS, {**GREEDY, "prompt": "Hi", "priority": bad}), 400,
                     param="priority")


async def test_the_class_ceiling_on_max_tokens(one_seat: Server) -> None:
    status, body = await one_seat.post(COMPLETIONS, {**GREEDY, "prompt": "Hi", "max_tokens": 501})
    assert_error(status, body, 400, param="max_tokens")
    assert "at most 500 in the 'interactive' class" in body["error"]["message"]
    for field in ("queue_timeout", "ttft_timeout", "token_timeout", "total_timeout"):
        assert_error(*await one_seat.post(COMPLETIONS, {**GREEDY, "prompt": "Hi", field: 0}), 400, param=field)


async def first_token_at(server: Server, body: dict[str, Any]) -> float:
    """The loop's clock when the stream's first token arrived (read to its end: leaving early
    would abort the request and free its seat)."""
    first = None
    async with server.session.post(COMPLETIONS, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"text":"' in line:
                first = asyncio.get_running_loop().time()
    assert first is not None, "no token"
    return first


async def test_an_interactive_request_takes_a_seat_from_the_batch_backlog(llm: LLMEngine) -> None:
    """tests/e2e/test_priority.py's order, without its timing: two seats run batch streams, two
    more wait; an interactive request arriving takes a seat at once (a batch stream is preempted)
    and gets its first token before either waiting batch request gets one."""
    policy = SchedulingPolicy(classes=DEFAULT_CLASSES, aging_seconds=0.0, shedding=ShedConfig(enabled=False))
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig.of(kv_cache_memory=16 * 2**20,
                                                              max_num_seqs=2, policy=policy))
    async with serve(engine) as server:
        # long enough that the two running streams are still running when the status loop looks
        # (a 24-token answer could end between two looks on a fast CPU, and the loop never end)
        long = {**LONG, "max_tokens": 96, "priority": "batch"}
        batch = [asyncio.ensure_future(first_token_at(server, {**long, "prompt": f"Story {i}:"})) for i in range(4)]
        while (body := (await server.get("/v1/status"))[1])["running"] < 2 or body["waiting"] < 2:
            await asyncio.sleep(0.01)
        interactive = await first_token_at(server, {**GREEDY, "prompt": "Hi", "priority": "interactive"})
        firsts = sorted(await asyncio.gather(*batch))
        _, status = await server.get("/v1/status")
    assert firsts[1] < interactive < firsts[2], (firsts, interactive)  # after the two running, before the two waiting
    assert status["preemptions"].get("recompute", 0) >= 1, status["preemptions"]


# -------------------------------------------------------------------------------- the door


async def test_a_burst_never_slips_past_the_queue_bound(one_seat: Server) -> None:
    # one request runs; max_waiting = 3 may wait; a burst of 20 arrives at once
    first = asyncio.ensure_future(one_seat.post(COMPLETIONS, LONG))
    await asyncio.sleep(0.3)
    burst = await asyncio.gather(*(one_seat.post(COMPLETIONS, {**GREEDY, "prompt": f"Item {i}"})
                                   for i in range(20)))
    statuses = sorted(status for status, _ in burst)
    assert statuses == [200] * 3 + [429] * 17, statuses
    for status, body in burst:
        if status == 429:
            assert_error(status, body, 429, code="queue_full")
            assert "interactive" in body["error"]["message"]
    assert (await first)[0] == 200
    body = await wait_idle(one_seat)
    assert body["rejections"] == {"queue_full": 17}
    assert body["classes"][0]["rejections"] == {"queue_full": 17}


async def test_429_carries_a_retry_after(one_seat: Server) -> None:
    first = asyncio.ensure_future(one_seat.post(COMPLETIONS, LONG))
    await asyncio.sleep(0.3)
    waiting = [asyncio.ensure_future(one_seat.post(COMPLETIONS, {**GREEDY, "prompt": f"Q{i}"})) for i in range(3)]
    await asyncio.sleep(0.1)
    async with one_seat.session.post(COMPLETIONS, json={**GREEDY, "prompt": "one too many"}) as r:
        assert_error(r.status, await r.json(), 429, code="queue_full")
        assert 1 <= int(r.headers["Retry-After"]) <= 60
    await asyncio.gather(first, *waiting)
    await wait_idle(one_seat)


async def test_a_predicted_deadline_miss_is_refused_at_the_door(server: Server) -> None:
    assert (await server.post(COMPLETIONS, {**GREEDY, "prompt": "warm the prefill rate up"}))[0] == 200
    async with server.session.post(COMPLETIONS, json={**GREEDY, "prompt": "Hi " * 200, "ttft_timeout": 1e-4}) as r:
        body = await r.json()
        assert_error(r.status, body, 429, code="deadline")
        assert int(r.headers["Retry-After"]) >= 1


async def test_draining_answers_503_with_retry_after(server: Server) -> None:
    server.door.server.draining = True  # the server's one switch (ServerState), read by every door
    async with server.session.post(COMPLETIONS, json={**GREEDY, "prompt": "Hi"}) as r:
        assert_error(r.status, await r.json(), 503, code="draining")
        assert r.headers["Retry-After"] == "5"
    _, ready = await server.get("/ready")
    assert ready == {"status": "draining"}


# -------------------------------------------------------------------------------- timeouts


async def test_a_queue_timeout_is_a_503_before_any_token(one_seat: Server) -> None:
    # the seat is held by a stream this test ends itself, however fast the CPU decodes
    holder = await one_seat.session.post(COMPLETIONS, json={**LONG, "max_tokens": 400, "stream": True})
    assert holder.status == 200 and (await holder.content.readline()).startswith(b"id: ")
    async with one_seat.session.post(COMPLETIONS, json={**GREEDY, "prompt": "Hi", "queue_timeout": 0.3}) as r:
        body = await r.json()
        assert_error(r.status, body, 503, code="queue_timeout")
        assert body["error"]["type"] == "timeout_error" and "queue timeout" in body["error"]["message"]
        assert r.headers["Retry-After"]
    # streamed: the choice ends with finish_reason "timeout", then an error event names it
    status, events = await stream_events(one_seat, {**GREEDY, "prompt": "Hi", "queue_timeout": 0.3})
    assert status == 200 and events[-1] == "data: [DONE]"
    *chunks, error = data_events(events)
    assert chunks[-1]["choices"][0]["finish_reason"] == "timeout"
    assert error["error"]["code"] == "queue_timeout"
    holder.close()  # a disconnect: the seat and its blocks come back
    body = await wait_idle(one_seat)
    assert body["timeouts"] == {"queue": 2} and body["classes"][0]["timeouts"] == {"queue": 2}


async def test_a_per_token_timeout_keeps_the_tokens_already_made(server: Server) -> None:
    # 1 ms between tokens cannot be met: it ends after its first token or so
    status, body = await server.post(COMPLETIONS, {**LONG, "token_timeout": 0.001})
    assert status == 200, body
    [choice] = body["choices"]
    assert choice["finish_reason"] == "timeout" and choice["text"]
    assert 1 <= body["usage"]["completion_tokens"] < LONG["max_tokens"]
    status, events = await stream_events(server, {**LONG, "token_timeout": 0.001})
    *chunks, error = data_events(events)
    assert chunks[-1]["choices"][0]["finish_reason"] == "timeout", events[-4:]
    assert error["error"] == {"message": "the request waited longer than its per-token timeout for the next token",
                              "type": "timeout_error", "param": None, "code": "token_timeout"}
    body = await wait_idle(server)
    assert body["timeouts"] == {"token": 2}
