"""Tool calls under tool_choice "auto" over real HTTP, on the real model at temperature 1: every
call the model starts is a call of a declared function with arguments valid against its schema,
on chat completions, the Responses API and Anthropic's Messages, streamed and whole; without the
grammar, the same loop gets malformed calls (so the test can fail). And one turn never repeats a
call: with tool_choice "required" and parallel calls, the default model repeats its call, and the
answer ends there with the repeat dropped.

NOTE: offered tools alone, the default model (SmolLM2-135M) seldom calls one; the prompt is a
conversation in which it has called get_weather twice before (a two-shot history), after which it
opens a call on nearly every seed, and a free-running one is often malformed: an undeclared
name, an enum value it made up, a block that is not JSON. Chat completions take each run's seed;
the Responses and Messages APIs have no seed field, so their runs draw anew each time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import jsonschema
import pytest
from apiserver import MODEL, Server, assert_pool_whole, data_events

from inferd.api.conversation import tool_grammar

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

WEATHER = {"name": "get_weather", "description": "The weather now in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The time now in a time zone", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
    "additionalProperties": False}}
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
# (city, temperature) of the earlier turns, then the question the model answers
EARLIER = [("Paris", 21), ("London", 15)]
QUESTION = "What's the weather in Rome?"
MAX_TOKENS = 48
Call = tuple[str, str]  # (name, arguments as JSON text)
Answer = tuple[list[Call], str]  # the calls, the text around them


def chat_messages() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, (city, degrees) in enumerate(EARLIER):
        arguments = json.dumps({"city": city, "unit": "celsius"})
        messages += [{"role": "user", "content": f"What's the weather in {city}?"},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function",
                      "function": {"name": "get_weather", "arguments": arguments}}]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps({"temperature": degrees})},
                     {"role": "assistant", "content": f"It is {degrees} degrees in {city}."}]
    return [*messages, {"role": "user", "content": QUESTION}]


async def chat(server: Server, seed: int, stream: bool) -> Answer:
    body = {"model": MODEL, "messages": chat_messages(), "max_tokens": MAX_TOKENS, "temperature": 1, "seed": seed,
            "tools": [{"type": "function", "function": f} for f in (WEATHER, TIME)]}
    if not stream:
        status, reply = await server.post("/v1/chat/completions", body)
        assert status == 200, reply
        message = reply["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or []]
        return calls, message["content"] or ""
    return await chat_stream(server, body)


async def chat_stream(server: Server, body: dict[str, Any]) -> Answer:
    _, events = await server.stream("/v1/chat/completions", body)
    text, calls = "", {}
    for chunk in data_events(events):
        for choice in chunk["choices"]:
            text += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls") or []:
                name, arguments = calls.get(call["index"], ("", ""))
                calls[call["index"]] = (name or call["function"].get("name", ""),
                                        arguments + call["function"].get("arguments", ""))
    return list(calls.values()), text


def responses_input() -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for message in chat_messages():
        if message.get("tool_calls"):
            [call] = message["tool_calls"]
            items.append({"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"]})
        elif message["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"],
                          "output": message["content"]})
        else:
            items.append({"role": message["role"], "content": message["content"]})
    return items


async def responses(server: Server, seed: int, stream: bool) -> Answer:
    body = {"model": MODEL, "input": responses_input(), "max_output_tokens": MAX_TOKENS, "temperature": 1,
            "tools": [{"type": "function", **f} for f in (WEATHER, TIME)]}  # (no seed here: each run draws anew)
    if stream:
        _, events = await server.stream("/v1/responses", body)
        reply = next(e["response"] for e in data_events(events) if e["type"] in ("response.completed",
                                                                                  "response.incomplete"))
    else:
        status, reply = await server.post("/v1/responses", body)
        assert status == 200, reply
    calls = [(o["name"], o["arguments"]) for o in reply["output"] if o["type"] == "function_call"]
    text = "".join(part["text"] for o in reply["output"] if o["type"] == "message" for part in o["content"])
    return calls, text


def anthropic_messages() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for message in chat_messages():
        if message.get("tool_calls"):
            [call] = message["tool_calls"]
            block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                     "input": json.loads(call["function"]["arguments"])}
            messages.append({"role": "assistant", "content": [block]})
        elif message["role"] == "tool":
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": message["tool_call_id"],
                                                          "content": message["content"]}]})
        else:
            messages.append(message)
    return messages


async def messages(server: Server, seed: int, stream: bool) -> Answer:
    body = {"model": MODEL, "messages": anthropic_messages(), "max_tokens": MAX_TOKENS, "temperature": 1,
            "tools": [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
                      for f in (WEATHER, TIME)]}
    if not stream:
        status, reply = await server.post("/v1/messages", body)
        assert status == 200, reply
        calls = [(b["name"], json.dumps(b["input"])) for b in reply["content"] if b["type"] == "tool_use"]
        return calls, "".join(b["text"] for b in reply["content"] if b["type"] == "text")
    _, events = await server.stream("/v1/messages", body)
    text, calls = "", {}
    for event in data_events(events):
        if event["type"] == "content_block_start" and event["content_block"]["type"] == "tool_use":
            calls[event["index"]] = (event["content_block"]["name"], "")
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
            name, arguments = calls[event["index"]]
            calls[event["index"]] = (name, arguments + event["delta"]["partial_json"])
        elif event["type"] == "content_block_delta":
            text += event["delta"]["text"]
    return list(calls.values()), text


Protocol = Callable[[Server, int, bool], Awaitable[Answer]]
PROTOCOLS: dict[str, Protocol] = {"chat": chat, "responses": responses, "messages": messages}


def malformed(answer: Answer) -> list[str]:
    """What is wrong with the calls an answer started: a call left as text (the parser could not
    read it), an undeclared function, arguments that are not JSON or fail the schema."""
    calls, text = answer
    problems = [f"a call left as text: {text!r}"] if "<tool_call>" in text else []
    for name, arguments in calls:
        if name not in SCHEMAS:
            problems.append(f"undeclared function {name!r}")
            continue
        try:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as e:
            problems.append(f"{name}({arguments}): {str(e).splitlines()[0]}")
    return problems


def started(answer: Answer) -> int:
    calls, text = answer
    return len(calls) + text.count("<tool_call>")


async def sample(server: Server, runs: list[tuple[str, int, bool]]) -> list[Answer]:
    """(protocol, seed, stream) runs, all at once (the engine batches them)."""
    return await asyncio.gather(*(PROTOCOLS[name](server, seed, stream) for name, seed, stream in runs))


def runs(seeds: int) -> list[tuple[str, int, bool]]:
    """Each protocol `seeds` times, streamed and whole in turn."""
    return [(name, seed, seed % 2 == 1) for name in PROTOCOLS for seed in range(seeds)]


@pytest.mark.parametrize("seeds", [pytest.param(2, id="2-seeds"), pytest.param(20, id="20-seeds", marks=pytest.mark.soak)])
async def test_every_call_started_under_auto_is_well_formed(server: Server, seeds: int) -> None:
    answers = await sample(server, runs(seeds))
    assert sum(map(started, answers)) >= len(answers) // 2, answers  # the prompt does make it call
    problems = [p for answer in answers for p in malformed(answer)]
    assert problems == [], problems
    await assert_pool_whole(server.engine, server.door)


@pytest.mark.soak
async def test_without_the_grammar_the_same_loop_gets_malformed_calls(server: Server,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # as for a model whose template has a format of its own: "auto" runs without a grammar
    monkeypatch.setattr(tool_grammar, "tool_format", lambda tokenizer: None)
    answers = await sample(server, runs(20))
    problems = [p for answer in answers for p in malformed(answer)]
    assert problems, answers


async def test_a_turn_ends_at_its_first_repeated_call_and_drops_it(server: Server) -> None:
    """Forced to call, with parallel calls allowed, the default model calls get_weather(Paris),
    get_time(Europe/Paris), then the same again up to the grammar's bound of 4 calls (129 tokens);
    here it stops at the first repeat (97 tokens), which the reply leaves out, streamed or whole."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
            "tools": [{"type": "function", "function": f} for f in (WEATHER, TIME)], "tool_choice": "required",
            "max_tokens": 160, "temperature": 0}
    (status, reply), (streamed, _) = await asyncio.gather(server.post("/v1/chat/completions", body),
                                                          chat_stream(server, body))
    assert status == 200, reply
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in reply["choices"][0]["message"]["tool_calls"]]
    assert len(set(calls)) == len(calls) and streamed == calls, (calls, streamed)
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    # it ended right after the first repeat: the calls kept, the one dropped, and nothing more
    call_tokens = len(server.engine.tokenizer.encode(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>\n'))
    assert reply["usage"]["completion_tokens"] <= (len(calls) + 1) * (call_tokens + 4), reply["usage"]
    await assert_pool_whole(server.engine, server.door)


async def test_tools_the_grammar_cannot_hold_leave_auto_free_but_refuse_required(server: Server) -> None:
    """An agent's tools may use what llguidance lacks (here a look-behind in a pattern): under
    "auto" the answer is served unconstrained rather than refused; "required" asked for the
    constraint, and gets the 400."""
    odd = {"name": "odd", "parameters": {"type": "object", "properties": {
        "word": {"type": "string", "pattern": "(?<=x)y"}}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": f} for f in (WEATHER, odd)]}
    status, reply = await server.post("/v1/chat/completions", body)
    assert status == 200, reply
    status, reply = await server.post("/v1/chat/completions", {**body, "tool_choice": "required"})
    assert status == 400 and reply["error"]["code"] == "invalid_grammar", reply


# a Llama-3.1-style template (its tool instructions and call rendering) in the default model's
# ChatML turns, so the default model can serve it
LLAMA3_TEMPLATE = """{%- if tools %}<|im_start|>system
Given the following functions, please respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. \
Do not use variables.

{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": \
{{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


async def test_a_llama3_template_gets_its_own_format(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from the template: the whole answer is one call, {"name", "parameters"}, forced under
    "required", held under "auto" (an answer that opens with "{" is a valid call), parsed back."""
    monkeypatch.setattr(server.engine.tokenizer, "chat_template", LLAMA3_TEMPLATE)
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 40, "temperature": 0,
            "tools": [{"type": "function", "function": f} for f in (WEATHER, TIME)], "tool_choice": "required"}
    (status, reply), streamed, *auto = await asyncio.gather(
        server.post("/v1/chat/completions", body), chat_stream(server, body),
        *(chat_stream(server, {**body, "tool_choice": "auto", "temperature": 1, "seed": seed}) for seed in range(2)))
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    [whole] = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert message["content"] is None and reply["choices"][0]["finish_reason"] == "tool_calls"
    assert malformed(([whole], "")) == [] and streamed == ([whole], "")
    for calls, text in auto:
        assert malformed((calls, text)) == [] and not text.lstrip().startswith("{"), (calls, text)
