"""A thinking budget, and a grammar that holds the content but not the reasoning, on every
protocol: the thinking-template server of test_reasoning.py (greedy, so that the same prompt
reasons the same way, the budgeted run's reasoning is the first tokens of the free one's)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from apiserver import MODEL, data_events, serve
from test_reasoning import SHOTS, thinking_llm  # noqa: F401  (the fixture)

from inferd.api.conversation import reasoning_grammar
from inferd.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.served  # it starts a real server

BUDGET = 3
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
PLAIN = [{"role": m["role"], "content": m["content"]} for m in SHOTS]  # (no reasoning sent back)


async def chat(server: Any, messages: list[dict[str, Any]], **fields: Any) -> tuple[dict[str, Any], list[str]]:
    """A greedy chat answer's message and its tokens' texts."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, "logprobs": True, **fields}
    status, whole = await server.post("/v1/chat/completions", body)
    assert status == 200, whole
    choice = whole["choices"][0]
    return choice["message"], [t["token"] for t in choice["logprobs"]["content"]]


def reasoned(tokens: list[str], close_tokens: int) -> int:
    """How many tokens of reasoning came before the closing marker (and the newline before it,
    as the template writes it), checking the marker was written whole."""
    at = next(i for i, t in enumerate(tokens) if t.startswith("</"))
    assert "".join(tokens[at:at + close_tokens]) == "</think>" and tokens[at - 1] == "\n", tokens
    return at - 1


@pytest.mark.asyncio
async def test_the_budget_ends_the_reasoning_at_its_count(thinking_llm: LLMEngine,  # noqa: F811
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    close_tokens = len(thinking_llm.tokenizer.encode("</think>", add_special_tokens=False))
    async with serve(thinking_llm) as server:
        free, free_tokens = await chat(server, SHOTS)
        assert reasoned(free_tokens, close_tokens) > BUDGET + 1, free_tokens  # it would think longer
        budgeted, tokens = await chat(server, SHOTS, thinking_token_budget=BUDGET)
        assert reasoned(tokens, close_tokens) == BUDGET and tokens[:BUDGET] == free_tokens[:BUDGET], tokens
        assert budgeted["reasoning"] == "".join(tokens[:BUDGET]) + "\n" and budgeted["content"].strip(), budgeted
        _, events = await server.stream("/v1/chat/completions", {"model": MODEL, "messages": SHOTS, "max_tokens": 24,
                                                                 "temperature": 0, "thinking_token_budget": BUDGET})
        deltas = [c["choices"][0]["delta"] for c in data_events(events) if c["choices"]]
        assert "".join(d.get("reasoning", "") for d in deltas) == budgeted["reasoning"]  # streamed alike

        # Anthropic's budget_tokens: the same prompt (thinking blocks render as the reasoning)
        client = anthropic.AsyncAnthropic(base_url=str(server.test_server.make_url("")), api_key="unused",
                                          max_retries=0)
        turns = [{"role": m["role"], "content": m["content"] if m["role"] == "user" else [
            {"type": "thinking", "thinking": m.get("reasoning_content") or m.get("reasoning"), "signature": ""},
            {"type": "text", "text": m["content"]}]} for m in SHOTS]
        message = await client.messages.create(model=MODEL, messages=turns, max_tokens=24,
                                               thinking={"type": "enabled", "budget_tokens": BUDGET},
                                               extra_body={"temperature": 0})
        assert message.content[0].thinking == budgeted["reasoning"], message.content

        # the Responses API's reasoning.effort, its budget lowered to BUDGET for the test
        monkeypatch.setitem(reasoning_grammar.EFFORT_BUDGETS, "minimal", BUDGET)
        plain, plain_tokens = await chat(server, PLAIN, thinking_token_budget=BUDGET)
        assert reasoned(plain_tokens, close_tokens) == BUDGET
        responses = openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused",
                                       max_retries=0)
        response = await responses.responses.create(model=MODEL, input=PLAIN, max_output_tokens=24, temperature=0,
                                                    reasoning={"effort": "minimal"})
        assert response.output[0].content[0].text == plain["reasoning"], response.output
        assert response.output_text == plain["content"]


@pytest.mark.asyncio
async def test_a_grammar_holds_the_content_not_the_reasoning(thinking_llm: LLMEngine,  # noqa: F811
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    async with serve(thinking_llm) as server:
        free, _ = await chat(server, SHOTS)
        message, _ = await chat(server, SHOTS, response_format=fmt, max_tokens=40)
        assert message["reasoning"] == free["reasoning"], message  # free reasoning: as without a grammar
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        tool = {"type": "function", "function": {"name": "add", "parameters": SCHEMA}}
        called, _ = await chat(server, SHOTS, tools=[tool], tool_choice="required", max_tokens=48)
        assert called["reasoning"] == free["reasoning"], called  # a tool call after it, as well
        [call] = called["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)

        # within a budget too (Responses' text.format and reasoning.effort)
        monkeypatch.setitem(reasoning_grammar.EFFORT_BUDGETS, "minimal", BUDGET)
        client = openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused", max_retries=0)
        response = await client.responses.create(
            model=MODEL, input=PLAIN, max_output_tokens=24, temperature=0, reasoning={"effort": "minimal"},
            text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}})
        reasoning = response.output[0].content[0].text
        assert len(thinking_llm.tokenizer.encode(reasoning, add_special_tokens=False)) <= BUDGET, reasoning
        jsonschema.validate(json.loads(response.output_text), SCHEMA)
