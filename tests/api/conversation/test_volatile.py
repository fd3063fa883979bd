"""Volatile prompt blocks (cache.volatile_prompt_patterns): Claude Code's billing header, which
changes on every request, is dropped before the prompt is rendered (the rest of the system kept),
counted in /metrics and in the request's usage; on every chat protocol; off with an empty list; a
bad pattern fails the start, before any model loads."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from apiserver import MODEL, Server, serve

from inferd.api.anthropic.cache import drop_volatile as drop_messages
from inferd.api.anthropic.wire import MessagesRequest
from inferd.api.conversation.volatile import VolatileBlocks
from inferd.api.openai.chat import drop_volatile as drop_chat
from inferd.api.openai.chat_wire import ChatCompletionRequest
from inferd.api.responses.create import drop_volatile as drop_responses
from inferd.api.responses.wire import ResponsesRequest
from inferd.api.server import serve as serve_forever
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.protocol import EngineRequest
from inferd.settings.config import Settings
from inferd.settings.values import SettingsError

DEFAULT = Settings().cache.volatile_prompt_patterns


def billing(cch: str = "a1b2c") -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.3.f00; cc_entrypoint=cli; cch={cch};"


def claude_code(cch: str = "a1b2c") -> dict[str, Any]:
    """A /v1/messages body as Claude Code sends it: the billing header first among the system blocks."""
    return {"model": MODEL, "max_tokens": 2, "temperature": 0, "metadata": {"user_id": "user_x_session_1"},
            "system": [{"type": "text", "text": billing(cch)},
                       {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
                       {"type": "text", "text": "Answer in one word.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]}


def test_blocks_and_plain_texts_that_match_are_dropped() -> None:
    volatile = VolatileBlocks(DEFAULT)
    assert volatile.strip(billing(), str) == ("", 1)
    assert volatile.strip("keep x-anthropic-billing-header: (not at the start)", str)[1] == 0
    assert volatile.strip(["a", billing(), 3], lambda b: b if isinstance(b, str) else None) == (["a", 3], 1)
    assert volatile.strip(None, str) == (None, 0)
    off = VolatileBlocks(())
    assert off.strip(billing(), str) == (billing(), 0) and not off.matches(billing())
    assert VolatileBlocks([r"cch=\w+;$", "^#"]).strip(["# a", "b cch=1;", "c"], str) == (["c"], 2)


def test_a_bad_pattern_is_a_settings_error_before_any_model_loads() -> None:
    with pytest.raises(SettingsError, match=r"cache.volatile_prompt_patterns: '\(unclosed' is not a regular"):
        VolatileBlocks(["^ok", "(unclosed"])
    settings = Settings.model_validate({"cache": {"volatile_prompt_patterns": ["(unclosed"]}})

    def load() -> Any:
        pytest.fail("the models were loaded despite a bad pattern")

    with pytest.raises(SettingsError, match="volatile_prompt_patterns"):
        asyncio.run(serve_forever(settings, frozenset(), load))


def test_each_protocol_drops_its_volatile_blocks_and_keeps_the_rest() -> None:
    volatile = VolatileBlocks(DEFAULT)
    body = MessagesRequest.model_validate({**claude_code(), "messages": [
        {"role": "user", "content": billing()}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": billing()}, {"type": "text", "text": "hi"}]}]})
    assert drop_messages(volatile, body) == 3
    assert body.system_text() == "You are Claude Code, Anthropic's official CLI for Claude.\n\nAnswer in one word."
    assert [m.content if isinstance(m.content, str) else [b.text for b in m.content] for m in body.messages] == [
        "", "ok", ["hi"]]  # (a message stays: the roles still alternate)
    only = MessagesRequest.model_validate({**claude_code(), "system": billing()})
    assert drop_messages(volatile, only) == 1 and only.system is None
    chat = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        {"role": "system", "content": [{"type": "text", "text": billing()}, {"type": "text", "text": "Be terse."}]},
        {"role": "developer", "content": billing()}, {"role": "user", "content": "Hi"},
        {"role": "tool", "content": billing(), "tool_call_id": "c1"}]})
    assert drop_chat(volatile, chat.messages) == 2
    assert [m.text() for m in chat.messages] == ["Be terse.", "", "Hi", billing()]  # (a tool's output is data)
    responses = ResponsesRequest.model_validate({"model": MODEL, "instructions": billing(), "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": billing()}]},
        {"role": "user", "content": "Hi"}]})
    assert drop_responses(volatile, responses) == 2 and responses.instructions is None
    assert [item.text() for item in responses.input] == ["", "Hi"]  # type: ignore[union-attr]
    assert drop_responses(VolatileBlocks(()), ResponsesRequest.model_validate({"model": MODEL, "input": billing()})) == 0


def record_prompts(server: Server, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each prompt the engine is handed, as text."""
    prompts: list[str] = []
    submit, tokenizer = server.engine.submit, server.engine.tokenizer

    def recording(request: EngineRequest, *args: Any, **kwargs: Any) -> Any:
        prompts.append(tokenizer.decode(request.prompt_ids))
        return submit(request, *args, **kwargs)

    monkeypatch.setattr(server.engine, "submit", recording)
    return prompts


async def volatile_total(server: Server) -> float:
    async with server.session.get("/metrics") as r:
        text = await r.text()
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("inferd_prompt_volatile_blocks_total"))


@pytest.mark.asyncio
@pytest.mark.served
async def test_claude_codes_billing_header_is_dropped_and_counted(server: Server,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = record_prompts(server, monkeypatch)
    assert await volatile_total(server) == 0
    status, first = await server.post("/v1/messages", claude_code("aaaaa"))
    assert status == 200, first
    assert "billing-header" not in prompts[0] and "You are Claude Code" in prompts[0] and "one word" in prompts[0]
    assert first["usage"]["prompt_cache"]["volatile_blocks"] == 1
    status, second = await server.post("/v1/messages", claude_code("bbbbb"))  # the header changed: the prompt not
    assert status == 200 and prompts[1] == prompts[0]
    assert second["usage"]["cache_read_input_tokens"] > 0  # its prefix, served from the cache
    prompt = {k: v for k, v in claude_code().items() if k in ("model", "system", "messages")}
    _, counted = await server.post("/v1/messages/count_tokens", prompt)
    _, without = await server.post("/v1/messages/count_tokens", {**prompt, "system": prompt["system"][1:]})
    assert counted["input_tokens"] == without["input_tokens"]  # (count_tokens drops it too, as /v1/messages does)
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "system", "content": billing()},
                                                         {"role": "user", "content": "Hi"}]}
    status, reply = await server.post("/v1/chat/completions", chat)
    assert status == 200 and reply["usage"]["prompt_cache"]["volatile_blocks"] == 1
    status, plain = await server.post("/v1/chat/completions", {**chat, "messages": chat["messages"][1:]})
    assert status == 200 and "volatile_blocks" not in plain["usage"]["prompt_cache"]
    assert await volatile_total(server) == 3  # (count_tokens is not counted: nothing was generated)


@pytest.mark.asyncio
@pytest.mark.served
async def test_an_empty_list_turns_it_off(llm: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    async with serve(llm, Settings.model_validate({"cache": {"volatile_prompt_patterns": []}})) as server:
        prompts = record_prompts(server, monkeypatch)
        status, reply = await server.post("/v1/messages", claude_code())
        assert status == 200 and "volatile_blocks" not in reply["usage"]["prompt_cache"]
        assert billing() in prompts[0] and await volatile_total(server) == 0
