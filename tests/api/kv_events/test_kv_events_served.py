"""KV-cache events from a real server on real sockets, read as a cache-aware router reads them: a
SUB socket and the replay socket, batches decoded with the wire structures, block hashes
recomputed from /tokenize's token ids with the documented blake2b chain."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from typing import Any

import pytest
import zmq
from apiserver import Server, serve
from kvclient import KV, PROMPT, Batch, Subscriber, chain, complete, events_server, kv_settings, replay, tokens_of

from inferd.api.admission.door import cache_namespace
from inferd.api.kv_events import KVEventPublisher
from inferd.api.kv_events.wire import AllBlocksCleared
from inferd.api.routing.registry import load_models
from inferd.api.routing.reload import reload_model
from inferd.api.routing.served import ModelSpec
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.settings.config import Settings

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

SLOW_JOINER_SECONDS = 0.3  # a SUB socket hears nothing published before its subscription arrives


def stored_blocks(batches: list[Batch]) -> dict[bytes, tuple[bytes | None, list[int], Any]]:
    """block hash -> (parent, its tokens, its extra key) from every GPU BlockStored."""
    blocks = {}
    for batch in batches:
        for event in batch.stored:
            assert event.medium == "GPU" and event.group_idx == 0 and event.lora_id is None
            parent = event.parent_block_hash
            for i, block_hash in enumerate(event.block_hashes):
                tokens = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
                blocks[block_hash] = (parent, tokens, event.extra_keys[i] if event.extra_keys else None)
                parent = block_hash
    return blocks


def assert_chain_stored(blocks: dict, tokens: list[int], bs: int, root: bytes = b"", with_tokens: bool = True) -> None:
    """Every full block of `tokens` was stored under the hash a router recomputes, chained to the one before."""
    keys = chain(tokens, bs, root)
    assert keys, "the prompt fills no block"
    for i, key in enumerate(keys):
        assert key in blocks, f"block {i} of the prompt was not published"
        parent, published, extra = blocks[key]
        assert parent == (keys[i - 1] if i else None)
        assert published == (tokens[i * bs:(i + 1) * bs] if with_tokens else [])
        assert extra == ((root.hex(),) if root and i == 0 else None)


async def test_a_prompts_blocks_reach_a_subscriber_and_a_late_one_replays_them(served_weights: tuple) -> None:
    with ExitStack() as closing:
        async with events_server(served_weights) as (server, publisher):
            live = closing.enter_context(Subscriber(publisher.endpoint))
            await asyncio.sleep(SLOW_JOINER_SECONDS)
            await check_live_and_replayed(server, publisher, live)
            heard = len(live.batches)
        # the server stopped: its cache is gone, and the subscriber hears so
        await live.until(lambda batches: len(batches) > heard and batches[-1].cleared, within=5)
        assert [b.batch.events for b in live.batches[heard:]][-1] == [AllBlocksCleared()]


async def check_live_and_replayed(server: Server, publisher: KVEventPublisher, live: Subscriber) -> None:
    bs = server.engine.limits.block_size
    tokens = await tokens_of(server, PROMPT)
    keys = chain(tokens, bs)
    await complete(server, PROMPT)
    got = await live.until(lambda batches: keys[-1] in stored_blocks(batches))
    assert_chain_stored(stored_blocks(got), tokens, bs)
    assert all(b.topic == b"" and b.batch.data_parallel_rank == 0 and b.batch.ts > 0 for b in got)
    # a router that came late (or lost batches) asks for everything from 0: the start-up probe's
    # batches too, numbered from 0 without a gap, and the live ones the same
    everything = await asyncio.to_thread(replay, publisher.replay_endpoint, 0)
    assert [b.seq for b in everything] == list(range(len(everything)))
    assert [(b.seq, b.batch) for b in everything[-len(got):]] == [(b.seq, b.batch) for b in got]
    assert [b.seq for b in await asyncio.to_thread(replay, publisher.replay_endpoint, got[-1].seq)] == [got[-1].seq]
    assert await asyncio.to_thread(replay, publisher.replay_endpoint, 2**63) == []
    async with server.session.get("/metrics") as r:
        metrics = await r.text()
    assert f"inferd_kv_events_published_batches_total {float(len(everything))}" in metrics, metrics
    assert "inferd_kv_events_replay_requests_total 3.0" in metrics
    assert "inferd_kv_events_dropped_batches_total 0.0" in metrics


@pytest.mark.parametrize("tenant_token_ids", [False, True])
async def test_a_cache_salts_namespace_rides_on_the_first_block(served_weights: tuple, tenant_token_ids: bool) -> None:
    async with events_server(served_weights, tenant_token_ids=tenant_token_ids) as (server, publisher):
        bs = server.engine.limits.block_size
        tokens = await tokens_of(server, PROMPT)
        await complete(server, PROMPT, cache_salt="s3cret")
        root = cache_namespace("", "s3cret")  # (a keyless caller's scope is "")
        blocks: dict = {}
        for _ in range(100):  # (until the publisher thread has sent the request's step)
            blocks = stored_blocks(await asyncio.to_thread(replay, publisher.replay_endpoint, 0))
            if chain(tokens, bs, root)[-1] in blocks:
                break
            await asyncio.sleep(0.05)
        assert_chain_stored(blocks, tokens, bs, root, with_tokens=tenant_token_ids)
        assert chain(tokens, bs)[0] not in blocks  # (the unsalted chain was never computed)


@pytest.mark.parametrize("taken", ["endpoint", "replay_endpoint"])
async def test_an_address_in_use_fails_the_start_up(served_weights: tuple, taken: str) -> None:
    context = zmq.Context()
    squatter = context.socket(zmq.PUB)
    squatter.bind("tcp://127.0.0.1:0")
    address = squatter.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        with pytest.raises(OSError, match=f"cannot bind {taken} {address}"):
            async with events_server(served_weights, **{taken: address}):
                pass
    finally:
        context.destroy(linger=0)


async def test_a_reload_clears_the_models_index_before_the_new_revision_publishes(served_weights: tuple) -> None:
    settings = kv_settings().model_copy(update={"models": Settings.model_validate(
        {"models": {"a": {}, "b": {}}}).models})

    def load(spec: ModelSpec) -> AsyncEngine:  # (every model and revision over the session's weights)
        return AsyncEngine(LLMEngine(*served_weights, EngineConfig.of(kv_cache_memory=KV).replace(
            kv_events=settings.kv_events)))

    fleet = load_models(settings, load)
    async with serve(fleet, settings) as server:
        publisher = fleet.kv_events
        bs = server.engine.limits.block_size
        with Subscriber(publisher.endpoint, topic=b"a") as live:  # (several models: the topic is the model's name)
            await asyncio.sleep(SLOW_JOINER_SECONDS)
            tokens = await tokens_of(server, PROMPT, "a")
            last = chain(tokens, bs)[-1]
            for model in ("a", "b"):
                await complete(server, PROMPT, model=model)
            await live.until(lambda batches: last in stored_blocks(batches))
            old = fleet.slots["a"].current
            await reload_model(fleet, fleet.server, fleet.slots["a"], ModelSpec(name="a", revision="2"))
            assert old.engine.kv_event_sink is None and fleet.slots["a"].current.engine.kv_event_sink is not None
            await complete(server, PROMPT, model="a")  # the new revision computes and files it again
            got = await live.until(lambda batches: any(b.cleared for b in batches) and last in stored_blocks(
                batches[next(i for i, b in enumerate(batches) if b.cleared):]))
            assert {b.topic for b in got} == {b"a"}
            cleared_at = [i for i, b in enumerate(got) if b.cleared]
            assert len(cleared_at) == 1 and got[cleared_at[0]].batch.events == [AllBlocksCleared()]
            assert_chain_stored(stored_blocks(got[cleared_at[0]:]), tokens, bs)  # (nothing of the old revision after)
            everything = await asyncio.to_thread(replay, publisher.replay_endpoint, 0)
            assert b"b" in {b.topic for b in everything}
