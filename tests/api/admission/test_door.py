"""The model's door, from the limits the engine publishes: what a request can never run gets a
400 naming the field in `prepare`, before anything is charged, admitted or submitted; what passes
is what the engine runs, its timeouts the class's tightened once."""

from __future__ import annotations

import asyncio

import pytest

from inferd.api.admission.ask import Ask
from inferd.api.admission.door import FrontDoor
from inferd.api.errors import APIError
from inferd.api.gateway.gate import Gateway
from inferd.api.gateway.tenants import ANONYMOUS, Keyring
from inferd.api.state import ServerState
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.settings.config import LimitSettings, Settings
from inferd.settings.policy import PriorityClass, Timeouts


def refused(call, *args, **kwargs) -> APIError:  # noqa: ANN001
    with pytest.raises(APIError) as e:
        result = call(*args, **kwargs)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    assert e.value.status == 400
    return e.value


def test_bad_prompts_and_requests_are_refused(llm: LLMEngine) -> None:
    small = LLMEngine(llm.model, llm.tokenizer, EngineConfig.of(kv_cache_memory=32 * 2**20))
    door = FrontDoor(AsyncEngine(small), ServerState("m"), LimitSettings())
    limits = door.limits
    gateway = Gateway(Keyring.build(Settings()), limits.policy)
    interactive = gateway.authorize(ANONYMOUS, "m", None)
    assert interactive.name == "interactive"
    prepare = door.prepare
    assert "empty" in refused(prepare, Ask("m"), [[]], interactive).message
    assert "outside the vocabulary" in refused(prepare, Ask("m"), [[1, 10**6]], interactive).message
    err = refused(prepare, Ask("m", prompt_param="messages"), [[1] * limits.max_model_len], interactive)
    assert err.param == "messages" and err.code == "context_length_exceeded"
    capacity = limits.class_kv_tokens["interactive"]
    assert capacity == limits.num_kv_blocks * limits.block_size < 4000  # no reserve in this class
    assert "KV cache" in refused(prepare, Ask("m", max_tokens=4000), [[1, 2, 3]], interactive).message
    wide = FrontDoor(AsyncEngine(small), ServerState("m"), LimitSettings(max_tokens_limit=8192))
    err = refused(wide.prepare, Ask("m", max_tokens=5000), [[1, 2, 3]], interactive)
    assert "at most 4096 in the 'interactive' class" in err.message and err.param == "max_tokens"
    err = refused(prepare, Ask("m", n=limits.max_num_seqs + 1), [[1, 2, 3]], interactive)
    assert err.param == "n"
    err = refused(gateway.authorize, ANONYMOUS, "m", "vip")
    assert "unknown priority 'vip'" in err.message and err.code == "unknown_priority"
    batch = gateway.authorize(ANONYMOUS, "m", "batch")
    assert limits.class_kv_tokens["batch"] < capacity  # its kv_reserve is kept for interactive
    assert door.queues.queued("interactive") == (0, 0) and door.queues.queued(batch.name) == (0, 0)
    assert small.group_ids() == []


def test_prepare_settles_max_tokens_and_timeouts_once(llm: LLMEngine) -> None:
    door = FrontDoor(AsyncEngine(llm), ServerState("m"), LimitSettings(max_tokens_default=256, max_tokens_limit=512))
    strict = PriorityClass("interactive", 0, timeouts=Timeouts(queue=5.0, token=1.0))
    tighter = asyncio.run(door.prepare(Ask("m", timeouts=Timeouts(queue=2.0)), [[1, 2, 3]], strict))
    looser = asyncio.run(door.prepare(Ask("m", timeouts=Timeouts(queue=50.0, token=9.0, total=30.0)), [[1]], strict))
    assert tighter.timeouts == Timeouts(queue=2.0, token=1.0)  # a request tightens its class's limits ...
    assert looser.timeouts == Timeouts(queue=5.0, token=1.0, total=30.0)  # ... and never loosens them
    assert tighter.params.max_tokens == 256  # the default
    short = LLMEngine(llm.model, llm.tokenizer, EngineConfig.of(kv_cache_memory=32 * 2**20,
                                                              max_model_len=512))
    fits = FrontDoor(AsyncEngine(short), ServerState("m"), LimitSettings(max_tokens_default=256))
    fitted = asyncio.run(fits.prepare(Ask("m", fit_default=True), [[1] * 502], strict))
    assert fitted.params.max_tokens == 10  # chat: a default fitted to the context left
    err = refused(fits.prepare, Ask("m"), [[1] * 502], strict)  # completions: the default as it is
    assert err.code == "context_length_exceeded" and "502 tokens and max_tokens is 256" in err.message
    err = refused(door.prepare, Ask("m", max_tokens=513), [[1]], strict)
    assert err.message == "max_tokens must be at most 512, got 513"
    capped = asyncio.run(door.prepare(Ask("m", max_tokens=400, stream=True), [[1]], strict, ceiling=64, whole=True))
    assert capped.params.max_tokens == 64 and capped.segment == "whole"  # the functional ladder's steps
    assert capped.cost == 1 + 64 and door.queues.queued("interactive") == (0, 0)  # nothing admitted by prepare
