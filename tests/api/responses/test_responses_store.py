"""Stored responses with the official `openai` client over a real socket: kept by default and
continued with previous_response_id (its prefix from the prefix cache), retrieved and deleted;
background responses followed live, replayed from starting_after, cancelled; two tenants that
cannot see each other's; the store's bounds under a storm and its time to live on a fake clock
(counted in /metrics). Generations are a few tokens each."""

from __future__ import annotations

import asyncio
import hashlib
import uuid

import openai
import pytest
from apiserver import MODEL, Server, assert_error, serve

from inferd.api.openapi import openapi_document
from inferd.api.responses.stored import RESPONSE_STORE
from inferd.engine.llm_engine import LLMEngine
from inferd.settings.config import Settings

pytestmark = pytest.mark.asyncio

LONG = {"input": "Write a long story about a lighthouse keeper.", "max_output_tokens": 400}  # cancelled long before


def client(server: Server, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key=key, max_retries=0)


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.mark.served
async def test_a_stored_response_is_retrieved_continued_from_the_prefix_cache_and_deleted(server: Server) -> None:
    c = client(server)
    # a first turn nothing cached yet begins with (a fresh uuid), some blocks long
    question = f"{uuid.uuid4()}: " + " ".join(f"Color {i} is not the one." for i in range(8)) + " Name a color."
    first = await c.responses.create(model=MODEL, input=question, max_output_tokens=4, temperature=0)
    assert first.store  # (the client sends no `store`: kept, as responses.store_by_default says)
    got = await c.responses.retrieve(first.id)
    assert (got.status, got.output_text, got.usage) == (first.status, first.output_text, first.usage)
    second = await c.responses.create(model=MODEL, input="And another one?", previous_response_id=first.id,
                                      max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    # the whole conversation was the prompt, and its first turn came from the prefix cache: every
    # full 16-token block of the first prompt (the same tokens), not only the default system prompt's
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 > 48
    unkept = await c.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    assert not unkept.store
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        await c.responses.cancel(first.id)
    await c.responses.delete(first.id)
    for gone in (c.responses.retrieve(first.id),
                 c.responses.create(model=MODEL, input="More?", previous_response_id=first.id, max_output_tokens=1)):
        with pytest.raises(openai.NotFoundError):
            await gone


@pytest.mark.served
async def test_background_responses_are_followed_replayed_and_cancelled(server: Server) -> None:
    c = client(server)
    async with await c.responses.create(model=MODEL, input="Count to ten.", max_output_tokens=8, temperature=0,
                                        background=True, stream=True) as stream:
        first = []
        async for event in stream:
            first.append(event)
            if len(first) == 3:
                break  # the client leaves: the response goes on
    response_id = first[0].response.id
    rest = [event async for event in await c.responses.retrieve(response_id, stream=True, starting_after=2)]
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    done = await c.responses.retrieve(response_id)
    assert done.background and done.status == events[-1].response.status
    assert done.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    replay = [event async for event in await c.responses.retrieve(response_id, stream=True, starting_after=4)]
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in events[5:]]

    long = await c.responses.create(model=MODEL, **LONG, background=True)
    assert long.status in ("queued", "in_progress")
    cancelled = await c.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and (await c.responses.retrieve(long.id)).status == "cancelled"
    assert (await c.responses.cancel(long.id)).status == "cancelled"  # again: the same answer
    ending = [event async for event in await c.responses.retrieve(long.id, stream=True)][-1]
    assert ending.type == "error" and ending.code == "response_cancelled"
    # (the KV pool is whole again: serve() checks it on the way out)


TENANTS = Settings.model_validate({"tenants": {name: {"key_sha256": [sha(f"sk-{name}")]} for name in ("alpha", "beta")},
                                   "responses": {"max_per_tenant": 2}})


@pytest.mark.served
async def test_a_tenant_never_reads_continues_replays_or_cancels_anothers_response(llm: LLMEngine) -> None:
    async with serve(llm, TENANTS) as server:
        alpha, beta = client(server, "sk-alpha"), client(server, "sk-beta")
        kept = await alpha.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        running = await alpha.responses.create(model=MODEL, **LONG, background=True)
        other = {"Authorization": "Bearer sk-beta"}
        for response_id in (kept.id, running.id, "resp-unknown"):
            for method, path in (("GET", ""), ("GET", "?stream=true&starting_after=0"), ("DELETE", ""),
                                 ("POST", "/cancel")):
                async with server.session.request(method, f"/v1/responses/{response_id}{path}", headers=other) as r:
                    assert_error(r.status, await r.json(), 404, code="response_not_found")
            status, body = await server.post("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 1,
                                                               "previous_response_id": response_id}, headers=other)
            assert_error(status, body, 404, param="previous_response_id", code="response_not_found")
        # alpha's own are untouched; its store holds 2 running at most (responses.max_per_tenant)
        assert (await alpha.responses.retrieve(kept.id)).output_text == kept.output_text
        second = await alpha.responses.create(model=MODEL, **LONG, background=True)
        with pytest.raises(openai.RateLimitError):
            await alpha.responses.create(model=MODEL, **LONG, background=True)
        betas = [await beta.responses.create(model=MODEL, **LONG, background=True) for _ in range(2)]  # its own
        await beta.responses.delete(betas[0].id)  # (a running one: cancelled, then forgotten)
        with pytest.raises(openai.NotFoundError):
            await beta.responses.retrieve(betas[0].id)
        for c, response_id in ((alpha, running.id), (alpha, second.id), (beta, betas[1].id)):
            assert (await c.responses.cancel(response_id)).status == "cancelled"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def evictions(server: Server) -> dict[str, float]:
    async with server.session.get("/metrics") as r:
        text = await r.text()
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("inferd_responses_evicted_total{")}


@pytest.mark.served
async def test_a_storm_leaves_nothing_past_the_bound_and_the_time_to_live(llm: LLMEngine) -> None:
    settings = Settings.model_validate({"responses": {"max_per_tenant": 3, "ttl_seconds": 60}})
    async with serve(llm, settings) as server:
        store = server.test_server.app[RESPONSE_STORE]
        store.clock = clock = Clock()  # (time to live without sleeping)
        assert await evictions(server) == {"ttl": 0, "capacity": 0}
        c = client(server)
        storm = await asyncio.gather(*(c.responses.create(model=MODEL, input=f"Say {i}.", max_output_tokens=1)
                                       for i in range(10)))
        kept = []
        for response in storm:
            try:
                kept.append(await c.responses.retrieve(response.id))
            except openai.NotFoundError:
                pass
        assert len(kept) == 3 and store.held == 3 and await evictions(server) == {"ttl": 0, "capacity": 7}
        clock.now += 60
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(kept[0].id)
        assert store.held == 0 and await evictions(server) == {"ttl": 3, "capacity": 7}


async def test_the_stored_responses_paths_are_documented_and_so_fuzzed() -> None:
    paths = openapi_document()["paths"]  # (tests/api/test_fuzz.py sends what it documents)
    assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert set(paths["/v1/responses/{response_id}/cancel"]) == {"post"}
    assert {"queued", "cancelled"} <= set(openapi_document()["components"]["schemas"]["Response"]["properties"]
                                          ["status"]["enum"])
