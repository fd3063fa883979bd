"""Resumable streams on the real default model over a real socket: a disconnect at random points,
then GET /v1/streams/<id> with Last-Event-ID (or ?after=N), gives exactly the uninterrupted
text (seeded sampling, not only greedy); only the caller that started a stream may resume or
cancel it (404 for anyone else); the grace period and DELETE free the KV blocks; a plain
stream's disconnect still frees them at once; a storm of 200 leaks nothing."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import aiohttp
import pytest
from apiserver import MODEL, Server, assert_error, serve

from inferd.api.gateway.keys import load_api_keys
from inferd.settings.config import Settings
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

COMPLETIONS = "/v1/completions"
# a short prompt (under one KV block: no prefix-cache hit makes one run differ from another)
SAMPLED = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 200, "temperature": 1.0, "seed": 1234,
           "ignore_eos": True, "stream": True}
RESUMABLE = {**SAMPLED, "resumable": True}
K1, K2 = "sk-resume-one", "sk-resume-two"

Event = tuple[int, dict[str, Any]]  # (sequence number, payload)


def grace(seconds: float) -> Settings:
    return Settings.model_validate({"server": {"resume_grace_seconds": seconds}})


async def read_events(response: aiohttp.ClientResponse, stop_after: int | None = None) -> tuple[list[Event], bool]:
    """Events until the one numbered `stop_after` (then stop reading), or [DONE] (then True)."""
    events: list[Event] = []
    event_id = None
    while line := (await response.content.readline()).decode():
        if line.startswith("id: "):
            event_id = line[4:].rstrip("\n")
        elif line.startswith("data: "):
            data = line[6:].rstrip("\n")
            if data == "[DONE]":
                return events, True
            payload = json.loads(data)
            response_id, _, number = event_id.rpartition(":")  # type: ignore[union-attr]
            assert response_id == payload.get("id", response_id)  # (an error event has no id field)
            events.append((int(number), payload))
            if stop_after is not None and int(number) >= stop_after:
                return events, False
    return events, False


def text_of(events: list[Event]) -> str:
    return "".join(c["text"] for _, p in events for c in p.get("choices", []))


async def wait_idle(server: Server, within: float, **kwargs: Any) -> dict[str, Any]:
    """/v1/status once no request holds a block, failing after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        status, body = await server.get("/v1/status", **kwargs)
        if body["kv_blocks_used"] == body["running"] == body["waiting"] == 0:
            return body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.02)


async def start(session: aiohttp.ClientSession, body: dict[str, Any], upto: int) -> tuple[str, list[Event]]:
    """POST a resumable stream, read up to event `upto`, then drop the connection."""
    async with session.post(COMPLETIONS, json=body) as r:
        assert r.status == 200, await r.text()
        events, done = await read_events(r, upto)
        r.close()  # abruptly: the connection goes, the server learns of it when it next writes
    assert not done
    return events[0][1]["id"], events


async def resume(session: aiohttp.ClientSession, response_id: str, after: int, upto: int | None = None, *,
                 query: bool = False) -> tuple[list[Event], bool]:
    """GET /v1/streams/<id> after event `after` (Last-Event-ID, or ?after=N), read up to `upto`."""
    params, headers = ({"after": after}, None) if query else (None, {"Last-Event-ID": f"{response_id}:{after}"})
    async with session.get(f"/v1/streams/{response_id}", params=params, headers=headers) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"] == "text/event-stream"
        events, done = await read_events(r, upto)
        if not done:
            r.close()
    return events, done


# ---------------------------------------------------------------------------- correctness


@pytest.mark.parametrize(("length", "cuts"), [pytest.param(200, 10, marks=pytest.mark.soak), (48, 6)])
async def test_resume_at_random_points_equals_an_uninterrupted_run(served_weights: tuple, length: int,
                                                                   cuts: int) -> None:
    """Seeded disconnect points (10 over 200 tokens in the soak tier, 6 over 48 in the default
    one), shared by two runs (each stream is resumed again after a second, third, ...
    disconnect): the same text, contiguous sequence numbers, as the same seeded request streamed
    without a break. The three run at once (a seeded choice's tokens do not depend on its batch,
    as for greedy ones)."""
    sampled, resumable = {**SAMPLED, "max_tokens": length}, {**RESUMABLE, "max_tokens": length}
    # (speculation off: the cut points are event numbers, one token an event; with it on, how many
    # tokens an event holds depends on what runs beside it)
    llm = LLMEngine(*served_weights, EngineConfig.of(kv_cache_memory=128 * 2**20, speculative="off"))
    async with serve(llm, grace(30)) as server:

        async def uninterrupted() -> list[Event]:
            async with server.session.post(COMPLETIONS, json=sampled) as r:
                whole, done = await read_events(r)
            assert done and len(whole) == length and [n for n, _ in whole] == list(range(length))
            return whole

        async def interrupted(cuts: list[int], query_at: int | None) -> list[Event]:
            response_id, events = await start(server.session, resumable, cuts[0])
            for i, upto in enumerate([*cuts[1:], None]):
                more, done = await resume(server.session, response_id, events[-1][0], upto, query=i == query_at)
                assert done == (upto is None)
                events += more
            return events

        points = sorted(random.Random(7).sample(range(0, length - 2), cuts))
        whole, *runs = await asyncio.gather(uninterrupted(), interrupted(points[0::2], None),
                                            interrupted(points[1::2], 2))
        for events in runs:
            assert [n for n, _ in events] == list(range(len(events)))  # none lost, none doubled
            assert text_of(events) == text_of(whole)
            assert events[-1][1]["choices"][0]["finish_reason"] == "length"
        await wait_idle(server, within=1.0)
        assert (await server.get("/v1/status"))[1]["resumable_streams_detached"] == 0


async def test_a_late_resume_gets_the_end_then_the_stream_is_gone(llm: LLMEngine) -> None:
    async with serve(llm, grace(30)) as server:
        body = {**RESUMABLE, "max_tokens": 12, "stream_options": {"include_usage": True}}
        response_id, events = await start(server.session, body, 2)
        await wait_idle(server, within=5.0)  # it finished while nobody was attached: blocks freed
        assert (await server.get("/v1/status"))[1]["resumable_streams_detached"] == 1
        more, done = await resume(server.session, response_id, 1)  # (event 2 again: it may not have arrived)
        assert done and more[0][0] == 2 and [n for n, _ in events[:2] + more] == list(range(len(more) + 2))
        assert more[-1][1]["usage"]["completion_tokens"] == 12
        async with server.session.get(f"/v1/streams/{response_id}") as r:  # delivered: dropped
            assert_error(r.status, await r.json(), 404, code="stream_not_found")


async def test_a_resume_replaces_a_writer_still_attached(llm: LLMEngine) -> None:
    async with serve(llm, grace(30)) as server:
        async with server.session.post(COMPLETIONS, json={**RESUMABLE, "max_tokens": 40}) as first:
            events, _ = await read_events(first, 3)
            response_id = events[0][1]["id"]
            more, done = await resume(server.session, response_id, 3)  # the first is still open
            assert done and more[-1][1]["choices"][0]["finish_reason"] == "length"
            rest, done = await read_events(first)  # the first writer ended without [DONE]
            assert not done
        assert [n for n, _ in events + more] == list(range(len(events) + len(more)))


# ------------------------------------------------------------------------ who, and errors


async def test_only_the_same_key_may_resume_or_cancel(llm: LLMEngine) -> None:
    async with serve(llm, grace(30), api_keys=load_api_keys([K1, K2], None, None)) as server:
        one, two = ({"Authorization": f"Bearer {k}"} for k in (K1, K2))
        body = {**RESUMABLE, "max_tokens": 1000}
        async with server.session.post(COMPLETIONS, json=body, headers=one) as r:
            events, _ = await read_events(r, 1)
            r.close()
        response_id = events[0][1]["id"]
        path = f"/v1/streams/{response_id}"
        for method in ("GET", "DELETE"):
            async with server.session.request(method, path, headers=two) as r:
                other = await r.json()
                assert_error(r.status, other, 404, code="stream_not_found")
            async with server.session.request(method, "/v1/streams/cmpl-0123", headers=two) as r:
                assert await r.json() == other | {"error": {**other["error"], "message": other["error"]["message"]
                                                           .replace(response_id, "cmpl-0123")}}
        async with server.session.get(path) as r:
            assert r.status == 401
        async with server.session.get(path, headers={**one, "Last-Event-ID": "cmpl-other:1"}) as r:
            assert_error(r.status, await r.json(), 400, param="Last-Event-ID")
        async with server.session.get(path, params={"after": "99999"}, headers=one) as r:
            assert_error(r.status, await r.json(), 400, param="after")
        async with server.session.delete(path, headers=one) as r:
            assert r.status == 200 and await r.json() == {"id": response_id, "object": "stream", "deleted": True}
        await wait_idle(server, within=0.5, headers=one)
        async with server.session.get(path, headers=one) as r:
            assert r.status == 404


async def test_resumable_needs_stream(server: Server) -> None:
    status, body = await server.post(COMPLETIONS, {**RESUMABLE, "stream": False})
    assert_error(status, body, 400, param="resumable")
    status, body = await server.post(COMPLETIONS, {**RESUMABLE, "resumable": 1})
    assert_error(status, body, 400, param="resumable")


async def test_a_cap_on_resumable_streams_held(llm: LLMEngine) -> None:
    settings = Settings.model_validate({"server": {"resume_grace_seconds": 30, "resume_max_streams": 1}})
    async with serve(llm, settings) as server:
        response_id, _ = await start(server.session, {**RESUMABLE, "max_tokens": 2000}, 1)
        async with server.session.post(COMPLETIONS, json={**RESUMABLE, "max_tokens": 4}) as r:
            assert_error(r.status, await r.json(), 429, code="too_many_resumable_streams")
            assert int(r.headers["Retry-After"]) >= 1
        async with server.session.post(COMPLETIONS, json={**SAMPLED, "max_tokens": 4}) as r:
            assert r.status == 200 and (await r.text()).endswith("data: [DONE]\n\n")  # plain ones still go
        async with server.session.delete(f"/v1/streams/{response_id}") as r:
            assert r.status == 200
        async with server.session.post(COMPLETIONS, json={**RESUMABLE, "max_tokens": 4}) as r:
            _, done = await read_events(r)
            assert r.status == 200 and done


async def test_shutdown_ends_resumable_streams_attached_or_not(llm: LLMEngine) -> None:
    async with serve(llm, grace(30)) as server:
        await start(server.session, {**RESUMABLE, "max_tokens": 2000}, 1)  # detached
        async with server.session.post(COMPLETIONS, json={**RESUMABLE, "max_tokens": 2000}) as r:
            await read_events(r, 1)
            started = time.monotonic()
            await server.test_server.close()
            rest, done = await asyncio.wait_for(read_events(r), 5)
        assert time.monotonic() - started < 3
        assert done and "shutting down" in rest[-1][1]["error"]["message"]


# ----------------------------------------------------------------------- freeing the cache


async def test_the_grace_ends_with_the_blocks_freed(llm: LLMEngine) -> None:
    async with serve(llm, grace(1.0)) as server:
        response_id, _ = await start(server.session, {**RESUMABLE, "max_tokens": 2000}, 2)
        await asyncio.sleep(0.5)
        _, status = await server.get("/v1/status")
        assert status["running"] == 1 and status["kv_blocks_used"] > 0 and status["resumable_streams_detached"] == 1
        await asyncio.sleep(0.7)  # the grace is over
        status = await wait_idle(server, within=0.5)
        assert status["resumable_streams_detached"] == 0
        async with server.session.get(f"/v1/streams/{response_id}") as r:
            assert r.status == 404


async def test_delete_frees_the_blocks_at_once_and_ends_a_writer(llm: LLMEngine) -> None:
    async with serve(llm, grace(30)) as server:
        response_id, _ = await start(server.session, {**RESUMABLE, "max_tokens": 2000}, 2)
        async with server.session.delete(f"/v1/streams/{response_id}") as r:
            assert r.status == 200
        await wait_idle(server, within=0.5)
        async with server.session.post(COMPLETIONS, json={**RESUMABLE, "max_tokens": 2000}) as r:
            events, _ = await read_events(r, 1)
            async with server.session.delete(f"/v1/streams/{events[0][1]['id']}") as d:
                assert d.status == 200
            rest, done = await read_events(r)
        assert done and rest[-1][1]["error"]["code"] == "stream_cancelled"
        await wait_idle(server, within=0.5)


async def test_a_plain_stream_disconnect_still_frees_at_once(llm: LLMEngine) -> None:
    async with serve(llm, grace(30)) as server:
        async with server.session.post(COMPLETIONS, json={**SAMPLED, "max_tokens": 2000}) as r:
            await read_events(r, 2)
            # the engine publishes its snapshot every 50 ms: look once it shows the stream's blocks
            deadline = asyncio.get_running_loop().time() + 10
            while server.engine.snapshot.kv_blocks_used == 0 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert server.engine.snapshot.kv_blocks_used > 0
            r.close()
        await wait_idle(server, within=0.5)


@pytest.mark.parametrize("streams", [pytest.param(200, marks=pytest.mark.soak), 24])
async def test_a_storm_of_resumable_streams_leaks_nothing(llm: LLMEngine, streams: int) -> None:
    """Resumable streams disconnect (200 in the soak tier, 24 in the default one); half resume to
    the end, half are left to the grace."""
    engine = LLMEngine(llm.model, llm.tokenizer,
                       EngineConfig.of(kv_cache_memory=256 * 2**20, max_num_seqs=256))
    async with serve(engine, grace(1.0)) as server:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(base_url=server.session._base_url, connector=connector) as session:

            async def one(i: int) -> None:
                body = {**RESUMABLE, "prompt": f"Item {i}:", "max_tokens": 16, "seed": i}
                response_id, events = await start(session, body, 1)
                if i % 2:
                    return  # left to the grace
                more, done = await resume(session, response_id, events[-1][0])
                assert done and [n for n, _ in events + more] == list(range(16))

            await asyncio.gather(*(one(i) for i in range(streams)))
        await asyncio.sleep(1.0)  # the grace of the abandoned half
        status = await wait_idle(server, within=10.0)
        assert status["resumable_streams_detached"] == 0
