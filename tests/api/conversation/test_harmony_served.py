"""gpt-oss served end to end, through the official clients: OpenAI's chat completions (tools
under "auto", "required" and a named function, reasoning_effort, a segmented stream), OpenAI's Responses and
Anthropic's Messages, whole and streamed alike.

The model is a tiny scripted gpt-oss (harmony_models.py): its greedy answer is
`<|channel|>final<|message|>Hello world<|return|>`, so free text is "Hello world"; under a forced
call the grammar writes harmony's call syntax (tool_grammar.py) and the answer parses into a call
whose arguments the parameters' schema pins (an enum, an empty object)."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest
from apiserver import MODEL, serve
from harmony_models import CALL_ANSWER, SCRIPTED_ANSWER, THINK_ANSWER, write_tiny_gpt_oss

from inferd.api.conversation.harmony import render
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.served, pytest.mark.asyncio]

UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": UNIT}},
         {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": NOTHING}}]
ARGUMENTS = {"get_weather": [{"unit": "c"}, {"unit": "f"}], "get_time": [{}]}  # all a forced call can say
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss")))


@pytest.fixture
def llm(folder: str) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig.of(model=folder, dtype="float32", kv_cache_memory=64 * 2**20))


def scripted(folder: str, answer: str, tmp_path: Path) -> LLMEngine:
    other = write_tiny_gpt_oss(tmp_path, answer=answer, tokenizer_from=Path(folder))
    return LLMEngine.from_config(EngineConfig.of(model=str(other), dtype="float32", kv_cache_memory=64 * 2**20))


async def test_a_call_nothing_forces_and_reasoning_are_separated(folder: str, tmp_path: Path) -> None:
    """The model's own call under "auto" on every protocol; its analysis as reasoning, not content."""
    async with serve(scripted(folder, CALL_ANSWER, tmp_path / "call")) as server:
        client = openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused", max_retries=0)
        chat = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=32,  # type: ignore[arg-type]
                                                    temperature=0, tool_choice="auto")
        [call] = chat.choices[0].message.tool_calls or []
        assert (call.function.name, call.function.arguments) == ("get_time", "{}")
        assert chat.choices[0].finish_reason == "tool_calls" and not chat.choices[0].message.content
        tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                 for t in TOOLS]
        response = await client.responses.create(model=MODEL, input=ASK, tools=tools, max_output_tokens=32)  # type: ignore[arg-type]
        assert [(i.name, i.arguments) for i in response.output if i.type == "function_call"] == [("get_time", "{}")]
        status, message = await server.post("/v1/messages", {
            "model": MODEL, "max_tokens": 32, "messages": [ASK[1]], "temperature": 0,
            "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]})
        assert status == 200 and [(b["name"], b["input"]) for b in message["content"] if b["type"] == "tool_use"] == [
            ("get_time", {})] and message["stop_reason"] == "tool_use"
        status, models = await server.get("/v1/models")  # operators see the experts
        assert status == 200 and (models["data"][0]["experts"], models["data"][0]["active_experts"]) == (4, 2)
        async with server.session.get("/metrics") as r:
            metrics = await r.text()
        assert 'inferd_moe_expert_tokens_total{expert="3"}' in metrics and "inferd_moe_layer_imbalance" in metrics
    async with serve(scripted(folder, THINK_ANSWER, tmp_path / "think")) as server:
        client = openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused", max_retries=0)
        chat = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=32, temperature=0,  # type: ignore[arg-type]
                                                    reasoning_effort="low")
        message = chat.choices[0].message
        assert getattr(message, "reasoning_content", None) == "Think" and not message.content


def a_call(name: str, arguments: str) -> bool:
    return name in ARGUMENTS and json.loads(arguments) in ARGUMENTS[name]


async def test_chat_completions(llm: LLMEngine) -> None:
    async with serve(llm) as server:
        status, tokenized = await server.post("/tokenize", {"model": MODEL, "messages": ASK})
        assert status == 200 and tokenized["tokens"] == render(ASK, []), tokenized
        client = openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused", max_retries=0)
        ask = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 64, "temperature": 0}
        free = await client.chat.completions.create(**ask, tool_choice="auto", reasoning_effort="high")
        assert free.choices[0].message.content == SCRIPTED_ANSWER and not free.choices[0].message.tool_calls
        assert free.choices[0].finish_reason == "stop"
        for segment in ("token", "line"):  # (a segmented stream's held-back tokens reach the parser too)
            stream = await client.chat.completions.create(**ask, stream=True, extra_body={"segment": segment})
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == SCRIPTED_ANSWER
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            whole = await client.chat.completions.create(**ask, tool_choice=choice)  # type: ignore[arg-type]
            [call] = whole.choices[0].message.tool_calls or []
            assert a_call(call.function.name, call.function.arguments), call
            assert whole.choices[0].finish_reason == "tool_calls" and call.id.startswith("call_")
            assert choice == "required" or call.function.name == "get_time"
            chunks = [c async for c in await client.chat.completions.create(**ask, tool_choice=choice, stream=True)]
            deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
            assert deltas[0].function.name == call.function.name
            assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
            assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_responses(llm: LLMEngine) -> None:
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    async with serve(llm) as server:
        client = openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused", max_retries=0)
        ask = {"model": MODEL, "input": ASK, "tools": tools, "max_output_tokens": 64, "temperature": 0}
        free = await client.responses.create(**ask, reasoning={"effort": "low"})
        assert free.output_text == SCRIPTED_ANSWER and free.status == "completed"
        whole = await client.responses.create(**ask, tool_choice="required")
        [call] = [item for item in whole.output if item.type == "function_call"]
        assert a_call(call.name, call.arguments), whole.output
        events = [e async for e in await client.responses.create(**ask, tool_choice="required", stream=True)]
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [e.arguments for e in done] == [call.arguments]
        assert events[-1].type == "response.completed"


async def test_anthropic_messages(llm: LLMEngine) -> None:
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    async with serve(llm) as server:
        client = anthropic.AsyncAnthropic(base_url=str(server.test_server.make_url("")), api_key="unused",
                                          max_retries=0)
        ask = {"model": MODEL, "system": "Be brief.", "messages": [ASK[1]], "tools": tools, "max_tokens": 64,
               "extra_body": {"temperature": 0}}
        free = await client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.text for b in free.content if b.type == "text"] == [SCRIPTED_ANSWER]
        assert free.stop_reason == "end_turn"
        whole = await client.messages.create(**ask, tool_choice={"type": "any"})
        [use] = [b for b in whole.content if b.type == "tool_use"]
        assert a_call(use.name, json.dumps(use.input)) and use.id.startswith("toolu_")
        assert whole.stop_reason == "tool_use"
        async with client.messages.stream(**ask, tool_choice={"type": "any"}) as stream:
            streamed = await stream.get_final_message()
        [again] = [b for b in streamed.content if b.type == "tool_use"]
        assert (again.name, again.input) == (use.name, use.input) and streamed.stop_reason == "tool_use"


async def test_a_blocklist_is_refused_for_a_harmony_model_at_load(folder: str, tmp_path: Path) -> None:
    """harmony answers are parsed from token ids, which the output filter does not see: refused at
    load, never served unfiltered."""
    from inferd.api.routing.served import ModelSpec
    from inferd.cli import _model_loader
    from inferd.settings.config import load_settings
    from inferd.text.errors import ModelLoadError

    blocklist = tmp_path / "blocklist.txt"
    blocklist.write_text("spoon\n")
    settings = load_settings(None, {"output_filter": {"blocklist_file": str(blocklist)},
                                    "model": {"dtype": "float32"}, "cache": {"kv_cache_memory": 16 * 2**20}},
                             environ={})
    with pytest.raises(ModelLoadError, match="output_filter"):
        _model_loader(settings)(ModelSpec(name="gpt-oss", path=folder))
