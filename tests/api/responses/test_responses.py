"""OpenAI's Responses API with the official `openai` client over a real socket: whole and streamed
answers that agree, the event sequence numbered and in order, a function-tool round trip (the
second turn served partly from the prefix cache), text.format as a schema, the refusals of what
is not served (an unknown previous response, a background one not kept, non-function tools), and
the policy that drops unsupported tools instead; Codex's first request (its namespace tool) as Codex
0.169 sends it. Stored responses: test_responses_store.py."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from apiserver import MODEL, Server, assert_pool_whole, data_events, serve

from inferd.engine.llm_engine import LLMEngine
from inferd.settings.config import Settings

pytestmark = pytest.mark.served  # it starts a real server

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}


def client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused", max_retries=0)


@pytest.mark.asyncio
async def test_whole_and_streamed_responses_agree_and_their_events_are_numbered(server: Server) -> None:
    c = client(server)
    ask = {"model": MODEL, "input": "Say hello.", "instructions": "Be brief.", "max_output_tokens": 10,
           "temperature": 0}
    whole = await c.responses.create(**ask)
    assert whole.id.startswith("resp") and whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.input_tokens > 0 and 0 < whole.usage.output_tokens <= 10
    assert (whole.incomplete_details is not None) == (whole.status == "incomplete")
    events = [event async for event in await c.responses.create(**ask, stream=True)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    await assert_pool_whole(server.engine, server.door)


@pytest.mark.asyncio
async def test_a_required_function_call_round_trip(server: Server) -> None:
    c = client(server)
    ask = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
           "parallel_tool_calls": False, "max_output_tokens": 40, "temperature": 0}
    whole = await c.responses.create(**ask)
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and whole.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    async with c.responses.stream(**ask) as stream:
        pieces = [e.delta async for e in stream if e.type == "response.function_call_arguments.delta"]
        final = await stream.get_final_response()
    assert "".join(pieces) == final.output[0].arguments == call.arguments
    turn = [{"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}]
    second = await c.responses.create(model=MODEL, input=turn, tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert second.output and second.usage.input_tokens > whole.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt, from the prefix cache
    await assert_pool_whole(server.engine, server.door)


@pytest.mark.asyncio
async def test_text_format_json_schema_binds_the_answer(server: Server) -> None:
    c = client(server)
    text = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    async with c.responses.stream(model=MODEL, input="Name a city in France as JSON.", text=text,
                                  max_output_tokens=30, temperature=1.0) as stream:
        final = await stream.get_final_response()
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), CITY)


REFUSED = [
    ({"previous_response_id": "resp_0"}, 404, "previous_response_id"),
    ({"background": True, "store": False}, 400, "background"),
    ({"tools": [{"type": "web_search"}]}, 400, "web_search"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": []}]}, 400, "tools"),
    ({"input": [{"type": "local_shell_call", "call_id": "c"}]}, 400, "local_shell_call"),
    ({"temperature": 3}, 400, "temperature"),
    ({"surprise": 1}, 400, "surprise"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("extra, status, named", REFUSED,
                         ids=["unknown-previous", "background-unkept", "web-search", "empty-namespace", "shell-item",
                              "temperature", "unknown-field"])
async def test_what_is_not_served_is_refused_in_openais_shape(server: Server, extra: dict, status: int,
                                                              named: str) -> None:
    got, reply = await server.post("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **extra})
    assert got == status, reply
    assert set(reply) == {"error"} and named in reply["error"]["message"] + str(reply["error"]["param"]), reply


@pytest.mark.asyncio
async def test_unsupported_tools_are_dropped_and_named_where_the_setting_says(llm: LLMEngine) -> None:
    """Codex sends web_search, Claude Code Anthropic's server tools: with [server] unsupported_tools =
    "drop" both protocols answer without them and name them in x-inferd-dropped-tools."""
    settings = Settings.model_validate({"server": {"unsupported_tools": "drop"}})
    cases = [("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                "tools": [{"type": "web_search"}, WEATHER]}, "web_search"),
             ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                               "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]},
              "web_search_20250305")]
    async with serve(llm, settings) as server:
        for path, body, dropped in cases:
            async with server.session.post(path, json=body) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-inferd-dropped-tools"] == dropped


# Codex 0.169.1's first request of a turn (`codex exec`, its default features), field for field and
# header for header; only the texts are shortened. Its sub-agent functions come as one `namespace`
# tool, which was a 400 ("tool type namespace is not supported") until namespaces were served.
CODEX_TURN = "01a23ad1-fa52-7ca3-937d-290f9d5d0d4a"
CODEX_HEADERS = {"Accept": "text/event-stream", "originator": "codex_exec", "session-id": CODEX_TURN,
                 "thread-id": CODEX_TURN, "x-client-request-id": CODEX_TURN, "x-codex-window-id": f"{CODEX_TURN}:0",
                 "x-codex-beta-features": "remote_compaction_v2", "x-codex-turn-metadata": '{"turn_trigger":"exec"}',
                 "User-Agent": "codex_exec/0.169.1 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.169.1)"}
AGENT = {"type": "object", "properties": {"target": {"type": "string", "maxLength": 8}}, "required": ["target"],
         "additionalProperties": False}
CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                    "additionalProperties": False}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for spawning and managing sub-agents.",
     "tools": [{"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
                "parameters": AGENT},
               {"type": "function", "name": "resume_agent", "description": "Resume a closed agent.", "strict": False,
                "parameters": AGENT}]},
]


def text(t: str) -> dict:
    return {"type": "input_text", "text": t}


def codex_body(**extra: object) -> dict:
    return {"model": MODEL, "stream": True, "input": [
        {"type": "message", "id": "msg_1", "role": "developer", "content": [text("You are a helpful assistant.")]},
        {"type": "message", "id": "msg_2", "role": "developer",
         "content": [text("<skills_instructions>none</skills_instructions>"), text("<permissions instructions>")]},
        {"type": "message", "id": "msg_3", "role": "user", "content": [text("<environment_context/>")]},
        {"type": "message", "id": "msg_4", "role": "user", "content": [text("What is the capital of France?")]}],
        "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
        "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": CODEX_TURN,
        "client_metadata": {"session_id": CODEX_TURN, "thread_id": CODEX_TURN, "turn_id": "t1"}, **extra}


@pytest.mark.asyncio
async def test_codex_first_request_with_its_namespace_tool_is_served(server: Server) -> None:
    """Codex's default request streams to response.completed; a call of a namespaced function
    (forced here) names its namespace, as Codex routes it, and goes back in as Codex sends it."""
    r, events = await server.stream("/v1/responses", codex_body(max_output_tokens=8, temperature=0),
                                    headers=CODEX_HEADERS)
    assert r.status == 200, events
    assert data_events(events)[-1]["type"] in ("response.completed", "response.incomplete")
    forced = codex_body(stream=False, tool_choice={"type": "function", "name": "close_agent"},
                        parallel_tool_calls=False, max_output_tokens=30, temperature=0)
    got, reply = await server.post("/v1/responses", forced, headers=CODEX_HEADERS)
    assert got == 200, reply
    [call] = reply["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "close_agent", "multi_agent_v1")
    back = codex_body(stream=False, max_output_tokens=4, temperature=0)
    back["input"] += [{k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")},
                      {"type": "function_call_output", "call_id": call["call_id"], "output": "closed"}]
    got, reply = await server.post("/v1/responses", back, headers=CODEX_HEADERS)
    assert got == 200, reply
    await assert_pool_whole(server.engine, server.door)
