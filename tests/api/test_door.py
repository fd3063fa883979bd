"""The front door's checks, from the limits the engine publishes: what a request can never run
gets a 400 naming the field, before anything is admitted or submitted."""

from __future__ import annotations

import pytest

from inferd.api.door import FrontDoor
from inferd.api.errors import APIError
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.model.sampling_params import SamplingParams


def refused(check, *args) -> APIError:  # noqa: ANN001
    with pytest.raises(APIError) as e:
        check(*args)
    assert e.value.status == 400
    return e.value


def test_bad_prompts_and_requests_are_refused(llm: LLMEngine) -> None:
    small = LLMEngine(llm.model, llm.tokenizer, EngineConfig(dtype="float32", kv_cache_memory=64 * 2**20))
    door = FrontDoor(AsyncEngine(small))
    limits = door.limits
    interactive = door.priority_class(None)
    assert interactive.name == "interactive"
    assert "empty" in refused(door.check_prompt, [], "prompt").message
    assert "outside the vocabulary" in refused(door.check_prompt, [1, 10**6], "prompt").message
    err = refused(door.check_prompt, [1] * limits.max_model_len, "messages")
    assert err.param == "messages" and err.code == "context_length_exceeded"
    capacity = limits.class_kv_tokens["interactive"]
    assert capacity == limits.num_kv_blocks * limits.block_size < 4000  # no reserve in this class
    too_long = SamplingParams(max_tokens=4000)
    assert "KV cache" in refused(door.check_request, [1, 2, 3], too_long, 1, interactive).message
    over_class = SamplingParams(max_tokens=5000)
    assert "at most 4096 in the 'interactive' class" in refused(
        door.check_request, [1, 2, 3], over_class, 1, interactive).message
    err = refused(door.check_request, [1, 2, 3], SamplingParams(), limits.max_num_seqs + 1, interactive)
    assert err.param == "n"
    err = refused(door.priority_class, "vip")
    assert "unknown priority 'vip'" in err.message and err.code == "unknown_priority"
    batch = door.priority_class("batch")
    assert limits.class_kv_tokens["batch"] < capacity  # its kv_reserve is kept for interactive
    assert door.admission.queued("interactive") == (0, 0) and small.group_ids() == []
