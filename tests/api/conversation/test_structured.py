"""Structured outputs and tool calls over real HTTP (the in-process server, the real model):
answers follow their grammar, streamed and not; tool calls come in OpenAI's shape, their streamed
fragments add up to the whole; earlier calls and tool results render into the prompt; logit_bias
moves the logits. The pool is whole after every test (apiserver.serve checks)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from apiserver import MODEL, Server, data_events

from inferd.api.openai.chat_wire import ChatCompletionChunk, ChatCompletionResponse

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}}, "required": ["zone"]}}}


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 80, **fields}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def streamed_choices(events: list[str]) -> dict[int, dict[str, Any]]:
    """Each choice's streamed content, tool calls (fragments joined) and finish reason."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in data_events(events):
        for c in chunk["choices"]:
            choice = choices.setdefault(c["index"], {"content": "", "calls": {}, "finish": None})
            choice["content"] += c["delta"].get("content") or ""
            for call in c["delta"].get("tool_calls") or []:
                seen = choice["calls"].setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
                if "id" in call:
                    assert seen["id"] is None  # id and name come once, in the call's first fragment
                    seen["id"], seen["name"] = call["id"], call["function"]["name"]
                seen["arguments"] += call["function"].get("arguments") or ""
            choice["finish"] = c["finish_reason"] or choice["finish"]
    return choices


async def test_a_schema_binds_greedy_and_sampled_choices_streamed_or_not(server: Server) -> None:
    body = chat("Name a large city and its population.", response_format=schema_format(CITY))
    status, reply = await server.post(CHAT, {**body, "temperature": 0})
    assert status == 200, reply
    text = reply["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), CITY)
    assert reply["choices"][0]["finish_reason"] == "stop"
    r, events = await server.stream(CHAT, {**body, "temperature": 0})
    assert streamed_choices(events)[0]["content"] == text  # greedy: the same answer either way
    status, reply = await server.post(CHAT, {**body, "temperature": 1.0, "seed": 7, "n": 3})
    for choice in reply["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), CITY)


@pytest.mark.parametrize("fmt, check", [
    ({"type": "choice", "choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"type": "regex", "regex": "[A-Z][a-z]+, [0-9]{4}"}, lambda t: t[0].isupper() and t[-4:].isdigit()),
    ({"type": "json_object"}, lambda t: isinstance(json.loads(t), dict)),
], ids=["choice", "regex", "json_object"])
async def test_the_completions_endpoint_takes_response_format_too(server: Server, fmt: dict, check) -> None:
    status, reply = await server.post(COMPLETIONS, {"model": MODEL, "prompt": ["My favourite:", "Reply:"],
                                                    "max_tokens": 120, "temperature": 0, "response_format": fmt})
    assert status == 200, reply
    for choice in reply["choices"]:
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
async def test_a_required_tool_call_in_openai_shape_streamed_or_not(server: Server, tool_choice: Any) -> None:
    body = chat("What's the weather in Paris?", tools=[WEATHER, TIME], tool_choice=tool_choice,
                parallel_tool_calls=False, temperature=0)
    status, reply = await server.post(CHAT, body)
    assert status == 200, reply
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    spec = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), spec["function"]["parameters"])
    ChatCompletionResponse.model_validate(reply)  # the shapes /openapi.json documents
    r, events = await server.stream(CHAT, body)
    for chunk in data_events(events):
        ChatCompletionChunk.model_validate(chunk)
    streamed = streamed_choices(events)[0]
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    [(index, got)] = streamed["calls"].items()
    assert index == 0 and got["name"] == call["function"]["name"] and got["arguments"] == call["function"]["arguments"]
    assert len([e for e in data_events(events) if e["choices"] and e["choices"][0]["delta"].get("tool_calls")]) > 1


async def test_parallel_calls_each_get_an_index_and_an_id(server: Server) -> None:
    # a forced grammar: one or more calls; what the model chooses is its business, the shape is ours
    # (a choice cut by max_tokens ends "length" and its last call's arguments where the cut fell)
    body = chat("Weather in Paris and in Rome, please.", tools=[WEATHER], tool_choice="required",
                temperature=1.0, seed=3, n=4)
    status, reply = await server.post(CHAT, body)
    assert status == 200, reply
    assert "tool_calls" in {choice["finish_reason"] for choice in reply["choices"]}, reply
    for choice in reply["choices"]:
        calls = choice["message"]["tool_calls"]
        assert calls and len({c["id"] for c in calls}) == len(calls)
        assert choice["finish_reason"] in ("tool_calls", "length"), choice
        whole = calls if choice["finish_reason"] == "tool_calls" else calls[:-1]
        for call in whole:
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


async def test_earlier_calls_and_tool_results_render_into_the_prompt(server: Server) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    status, reply = await server.post("/tokenize", {"model": MODEL, "messages": messages, "tools": [WEATHER]})
    assert status == 200, reply
    status, prompt = await server.post("/detokenize", {"model": MODEL, "tokens": reply["tokens"]})
    text = prompt["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    assert '"name": "get_weather"' in text.split("<tools>\n")[1]  # the tools' instructions, in the system turn
    status, reply = await server.post(CHAT, {**chat("x"), "messages": messages, "tools": [WEATHER], "temperature": 0})
    assert status == 200, reply
    status, reply = await server.post("/tokenize", {"model": MODEL, "messages": messages[:1]})
    assert "<tools>" not in (await server.post("/detokenize", {"model": MODEL, "tokens": reply["tokens"]}))[1]["prompt"]


async def test_metrics_count_structured_requests_by_kind(server: Server) -> None:
    await server.post(CHAT, chat("Hi", response_format=schema_format(CITY), max_tokens=4))
    await server.post(CHAT, chat("Hi", response_format={"type": "regex", "regex": "(unclosed"}))
    async with server.session.get("/metrics") as r:
        text = await r.text()
    assert 'inferd_structured_requests_total{kind="json_schema"} 1.0' in text
    assert 'inferd_structured_requests_total{kind="invalid"} 1.0' in text
    assert 'inferd_structured_requests_total{kind="tools"} 0.0' in text


async def test_tool_choice_none_offers_no_tools(server: Server) -> None:
    status, reply = await server.post(CHAT, chat("Weather in Paris?", tools=[WEATHER], tool_choice="none",
                                                 temperature=0, max_tokens=12))
    assert status == 200 and reply["choices"][0]["message"]["tool_calls"] is None


async def test_logit_bias_moves_the_logits(server: Server) -> None:
    token = server.engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    status, plain = await server.post(COMPLETIONS, {**body, "logprobs": 0})
    assert not plain["choices"][0]["text"].startswith(" banana")
    status, biased = await server.post(COMPLETIONS, {**body, "logit_bias": {str(token): 100}})
    assert status == 200 and biased["choices"][0]["text"] == " banana" * 3
    first = server.engine.tokenizer.encode(plain["choices"][0]["text"], add_special_tokens=False)[0]
    status, banned = await server.post(COMPLETIONS, {**body, "logit_bias": {str(first): -100}})
    assert not banned["choices"][0]["text"].startswith(plain["choices"][0]["text"])
