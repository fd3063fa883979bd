"""Anthropic's Messages API with the official `anthropic` client over a real socket: whole and
streamed answers that agree, tool use forced and sent back, stop sequences, count_tokens equal to
the usage, errors in Anthropic's shape, x-api-key, and a max_tokens over the ceiling clamped."""

from __future__ import annotations

import hashlib
import json

import anthropic
import jsonschema
import pytest
from apiserver import MODEL, Server, assert_pool_whole, serve

from inferd.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.served  # it starts a real server

GREEDY = {"temperature": 0}  # (not in the 2026 SDK's signature: sent as extra_body)
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                            "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def client(server: Server, api_key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(server.test_server.make_url("")), api_key=api_key, max_retries=0)


@pytest.mark.asyncio
async def test_whole_and_streamed_answers_agree_and_count_their_tokens(server: Server) -> None:
    c = client(server)
    whole = await c.messages.create(model=MODEL, max_tokens=12, system="You are terse.", messages=ASK,
                                    extra_body=GREEDY)
    assert whole.role == "assistant" and whole.model == MODEL and whole.id.startswith("msg")
    [block] = whole.content
    assert block.type == "text" and block.text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens <= 12
    counted = await c.messages.count_tokens(model=MODEL, system="You are terse.", messages=ASK)
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == counted.input_tokens
    kinds = []
    async with c.messages.stream(model=MODEL, max_tokens=12, system="You are terse.", messages=ASK,
                                 extra_body=GREEDY) as stream:
        async for event in stream:
            kinds.append(event.type)
        streamed = await stream.get_final_message()
    assert streamed.content[0].text == block.text and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    await assert_pool_whole(server.engine, server.door)


@pytest.mark.asyncio
async def test_a_forced_tool_use_validates_and_its_result_goes_back(server: Server) -> None:
    c = client(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    whole = await c.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER], tool_choice=choice, messages=ask,
                                    extra_body=GREEDY)
    [use] = [b for b in whole.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_") and whole.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    async with c.messages.stream(model=MODEL, max_tokens=40, tools=[WEATHER], tool_choice=choice, messages=ask,
                                 extra_body=GREEDY) as stream:
        pieces = [e.delta.partial_json async for e in stream if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        streamed = await stream.get_final_message()
    [streamed_use] = [b for b in streamed.content if b.type == "tool_use"]
    assert json.loads("".join(pieces)) == streamed_use.input == use.input and streamed.stop_reason == "tool_use"
    # the round trip: the call and its result in the history, then an answer in text
    history = [*ask, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                         "input": use.input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "18 degrees and sunny"}]}]
    answer = await c.messages.create(model=MODEL, max_tokens=16, tools=[WEATHER], messages=history, extra_body=GREEDY)
    assert answer.content and answer.usage.input_tokens + answer.usage.cache_read_input_tokens > whole.usage.input_tokens
    await assert_pool_whole(server.engine, server.door)


@pytest.mark.asyncio
async def test_a_stop_sequence_ends_the_answer_and_is_named(server: Server) -> None:
    c = client(server)
    free = await c.messages.create(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY)
    word = free.content[0].text.split()[2]  # a word the greedy answer writes
    cut = await c.messages.create(model=MODEL, max_tokens=12, messages=ASK, stop_sequences=[word], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert word not in cut.content[0].text and free.content[0].text.startswith(cut.content[0].text)


BAD = [
    ({"model": "nope", "max_tokens": 5, "messages": ASK}, 404, "not_found_error", "nope"),
    ({"model": MODEL, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error", "image"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web"}]},
     400, "invalid_request_error", "web_search_20250305"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "missing"}}, 400, "invalid_request_error", "missing"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "surprise": 1}, 400, "invalid_request_error", "surprise"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("body, status, kind, named", BAD, ids=[
    "unknown-model", "no-max-tokens", "temperature", "image", "server-tool", "unknown-tool", "unknown-field"])
async def test_bad_requests_get_anthropics_error_shape(server: Server, body: dict, status: int, kind: str,
                                                       named: str) -> None:
    got_status, reply = await server.post("/v1/messages", body)
    assert got_status == status, reply
    assert reply["type"] == "error" and reply["error"]["type"] == kind and named in reply["error"]["message"], reply
    assert set(reply) == {"type", "error"} and set(reply["error"]) == {"type", "message"}


@pytest.mark.asyncio
async def test_claude_codes_fields_are_accepted_and_max_tokens_is_clamped(server: Server) -> None:
    body = {"model": MODEL, "max_tokens": 32000, "stream": False, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}],
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "adaptive"}, "metadata": {"user_id": "u1"}, "output_config": {"effort": "high"},
        "context_management": {"edits": []}, "tools": [{**WEATHER, "defer_loading": True}],
        "stop_sequences": [".", "\n"]}  # (a short answer: the clamp is what is checked)
    async with server.session.post("/v1/messages?beta=true", json=body, headers={
            "anthropic-version": "2023-06-01", "anthropic-beta": "context-management-2025-06-27"}) as r:
        reply = await r.json()
        assert r.status == 200, reply
        ceiling = int(r.headers["x-inferd-max-tokens-clamped"])
    assert 0 < ceiling < 32000 and reply["usage"]["output_tokens"] <= ceiling
    await assert_pool_whole(server.engine, server.door)


@pytest.mark.asyncio
async def test_x_api_key_authenticates_and_a_wrong_one_is_anthropics_401(llm: LLMEngine) -> None:
    async with serve(llm, api_keys=frozenset({hashlib.sha256(b"right-key").hexdigest()})) as server:
        ok = await client(server, "right-key").messages.create(model=MODEL, max_tokens=2, messages=ASK,
                                                                extra_body=GREEDY)
        assert ok.usage.output_tokens <= 2
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await client(server, "wrong-key").messages.create(model=MODEL, max_tokens=2, messages=ASK)
        assert refused.value.status_code == 401
        assert refused.value.body["error"]["type"] == "authentication_error"
