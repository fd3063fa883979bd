"""Why the prefix cache missed, in the usage and the log line: `usage.prompt_cache` ({cached_tokens,
host_tokens, miss}, and volatile_blocks where some were dropped) on every generation protocol,
whole and streamed, built from each prompt's first choice's RequestMetrics; the request's log
line gets host_cached_tokens and cache_miss."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from apiserver import MODEL, Server, data_events

from inferd.api.admission.ask import Prepared
from inferd.api.record import RequestRecord
from inferd.api.streaming.generation import Generation
from inferd.engine.protocol import EngineOutput, RequestMetrics
from inferd.settings.policy import PriorityClass, Timeouts
from inferd.text.sampling_params import SamplingParams


def finished(group_id: int, index: int, cached: int, host: int, miss: str | None) -> EngineOutput:
    metrics = RequestMetrics("interactive", prompt_tokens=64, cached_tokens=cached, output_tokens=1, queue_time=0.0,
                             ttft=0.1, e2e=0.2, preemptions=0, host_cached_tokens=host, cache_miss=miss)
    return EngineOutput(group_id, [7], "x", index=index, finished=True, finish_reason="stop", metrics=metrics)


def test_each_prompts_first_choice_makes_the_prompt_cache_usage() -> None:
    prepared = Prepared(prompts=[[1] * 64, [2] * 64], params=SamplingParams(max_tokens=1), n=2,
                        cls=PriorityClass("interactive", 0), timeouts=Timeouts(), segment="token", constraints=None)
    record = RequestRecord()
    gen = Generation(None, prepared, "cmpl", record, volatile_blocks=2)  # type: ignore[arg-type]  # (no door: not entered)
    assert gen.usage()["prompt_cache"] == {"cached_tokens": 0, "host_tokens": 0, "miss": None, "volatile_blocks": 2}
    gen.note(finished(11, 1, 64, 64, None))  # a second choice: not counted (its prompt is its first's)
    gen.note(finished(12, 0, 16, 0, "evicted"))
    gen.note(finished(11, 0, 32, 16, "diverged at token 40"))
    assert gen.usage()["prompt_cache"] == {"cached_tokens": 48, "host_tokens": 16, "miss": "diverged at token 40",
                                           "volatile_blocks": 2}  # (the first prompt's reason)
    assert gen.usage()["prompt_tokens_details"] == {"cached_tokens": 48}
    assert (record.cached_tokens, record.host_cached_tokens, record.volatile_blocks) == (48, 16, 2)
    assert record.cache_miss == "diverged at token 40"


def check(usage: dict[str, Any], cached: int) -> None:
    cache = usage["prompt_cache"]
    assert set(cache) == {"cached_tokens", "host_tokens", "miss"}, cache
    assert cache["cached_tokens"] == cached and 0 <= cache["host_tokens"] <= cached
    assert cache["miss"] is None or isinstance(cache["miss"], str)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


@pytest.mark.asyncio
@pytest.mark.served
async def test_every_generation_protocol_has_it_whole_and_streamed(server: Server) -> None:
    status, whole = await server.post("/v1/chat/completions", CHAT)
    assert status == 200
    check(whole["usage"], whole["usage"]["prompt_tokens_details"]["cached_tokens"])
    _, events = await server.stream("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
    usage = data_events(events)[-1]["usage"]
    check(usage, usage["prompt_tokens_details"]["cached_tokens"])
    completion = {"model": MODEL, "prompt": ["Hi", "Ho"], "max_tokens": 2, "temperature": 0}
    status, whole = await server.post("/v1/completions", completion)
    assert status == 200
    check(whole["usage"], whole["usage"]["prompt_tokens_details"]["cached_tokens"])
    _, events = await server.stream("/v1/completions", {**completion, "stream_options": {"include_usage": True}})
    usage = data_events(events)[-1]["usage"]
    check(usage, usage["prompt_tokens_details"]["cached_tokens"])
    status, response = await server.post("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2})
    assert status == 200
    check(response["usage"], response["usage"]["input_tokens_details"]["cached_tokens"])
    _, events = await server.stream("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2})
    completed = data_events(events)[-1]
    assert completed["type"] in ("response.completed", "response.incomplete")
    check(completed["response"]["usage"], completed["response"]["usage"]["input_tokens_details"]["cached_tokens"])
    message = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    status, reply = await server.post("/v1/messages", message)
    assert status == 200
    check(reply["usage"], reply["usage"]["cache_read_input_tokens"])
    _, events = await server.stream("/v1/messages", message)
    delta = next(e for e in data_events(events) if e["type"] == "message_delta")
    check(delta["usage"], delta["usage"]["cache_read_input_tokens"])


@pytest.mark.asyncio
@pytest.mark.served
async def test_the_log_line_has_the_host_tokens_and_the_miss(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inferd.requests")
    status, _ = await server.post("/v1/chat/completions", CHAT)
    assert status == 200
    [line] = [r.fields for r in caplog.records if r.name == "inferd.requests"]  # type: ignore[attr-defined]
    assert line["host_cached_tokens"] == 0  # (the engine's host tier: none on this server)
    assert isinstance(line.get("cache_miss", ""), str)  # (absent on a full hit, as every None field)
