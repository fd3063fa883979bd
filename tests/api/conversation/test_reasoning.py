"""Reasoning as its own channel on /v1/chat/completions: a thinking model's answer split into
`reasoning_content` (and its new name `reasoning`, both sent) and `content`, the same whole and
streamed, for every chunking of the text; either name taken back in an assistant message.

The served model is the default one under a thinking chat template (Qwen3's markers, the block
opened by the generation prompt as DeepSeek-R1's template does), with two earlier turns that
show it the shape, so that greedy decoding closes its reasoning and answers."""

from __future__ import annotations

import copy

import anthropic
import openai
import pytest
from apiserver import MODEL, data_events, serve
from hypothesis import given
from hypothesis import strategies as st

from inferd.api.conversation.reasoning import THINK, ReasoningSplitter, split_whole, starts_inside
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}")
SHOTS = [{"role": "user", "content": "What is 2 + 2?"},
         {"role": "assistant", "reasoning_content": "Two plus two is four.", "content": "4"},
         {"role": "user", "content": "What is 3 + 3?"},
         {"role": "assistant", "reasoning": "Three plus three is six.", "content": "6"},  # (the new name, taken too)
         {"role": "user", "content": "What is 4 + 4?"}]
PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "\n", "a", "b c", " "])


@given(st.lists(PIECES, max_size=12).map("".join), st.lists(st.integers(0, 40), max_size=6), st.booleans())
def test_every_chunking_splits_the_same(text: str, cuts: list[int], inside: bool) -> None:
    whole = split_whole(text, THINK, inside)
    splitter, bounds = ReasoningSplitter(THINK, inside), sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [p for a, b in zip(bounds, bounds[1:]) for p in splitter.feed(text[a:b])] + splitter.finish()
    assert (splitter.reasoning, "".join(p.text for p in pieces if p.channel == "content")) == whole


def test_the_split() -> None:
    assert split_whole("<think>\nsteps\n</think>\n\nthe answer", THINK) == ("steps\n", "the answer")
    assert split_whole("steps</think>answer <think>x</think>", THINK, inside=True) == ("steps", "answer <think>x</think>")
    assert split_whole("no reasoning <think>here</think>", THINK) == ("", "no reasoning <think>here</think>")
    assert split_whole("<think>cut short", THINK) == ("cut short", "")
    assert starts_inside("<|im_start|>assistant\n<think>\n", THINK)
    assert not starts_inside("<think>\n\n</think>\n\n", THINK)


@pytest.fixture
def thinking_llm(served_weights: tuple) -> LLMEngine:
    model, tokenizer = served_weights
    thinking = copy.copy(tokenizer)  # (the session's tokenizer keeps its own template)
    thinking.chat_template = THINKING_TEMPLATE
    return LLMEngine(model, thinking, EngineConfig.of(kv_cache_memory=64 * 2**20))


@pytest.mark.served
@pytest.mark.asyncio
async def test_reasoning_and_content_whole_and_streamed(thinking_llm: LLMEngine) -> None:
    body = {"model": MODEL, "messages": SHOTS, "max_tokens": 24, "temperature": 0}
    async with serve(thinking_llm) as server:
        status, whole = await server.post("/v1/chat/completions", body)
        assert status == 200, whole
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"] == message["reasoning"] and message["reasoning"].strip()
        assert message["content"].strip() and "</think>" not in message["content"] + message["reasoning"]
        response, events = await server.stream("/v1/chat/completions", body)
        deltas = [c["choices"][0]["delta"] for c in data_events(events) if c["choices"]]
        assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
        assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
        assert "".join(d.get("content") or "" for d in deltas) == message["content"]
        off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
        status, plain = await server.post("/v1/chat/completions", off)
        assert status == 200 and "reasoning" not in plain["choices"][0]["message"], plain


@pytest.mark.served
@pytest.mark.asyncio
async def test_either_name_goes_back_into_the_template(thinking_llm: LLMEngine) -> None:
    async with serve(thinking_llm) as server:
        for name in ("reasoning_content", "reasoning"):
            turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", name: "Greet back.", "content": "Hello"}]
            status, rendered = await server.post("/tokenize", {"model": MODEL, "messages": turn})
            assert status == 200, rendered
            text = thinking_llm.tokenizer.decode(rendered["tokens"], skip_special_tokens=False)
            assert "<think>\nGreet back.\n</think>\n\nHello" in text, text


@pytest.mark.served
@pytest.mark.asyncio
async def test_responses_carry_the_reasoning_as_a_reasoning_item(thinking_llm: LLMEngine) -> None:
    turns = [{"role": m["role"], "content": m["content"]} for m in SHOTS]
    ask = {"model": MODEL, "input": turns, "max_output_tokens": 24, "temperature": 0}
    async with serve(thinking_llm) as server:
        client = openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused", max_retries=0)
        whole = await client.responses.create(**ask)
        assert whole.output[0].type == "reasoning" and whole.output[0].content[0].text.strip()
        events = [event async for event in await client.responses.create(**ask, stream=True)]
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert reasoning == whole.output[0].content[0].text
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
        done = [e for e in events if e.type == "response.reasoning_text.done"]
        assert [e.text for e in done] == [reasoning] and events[-1].response.output[0].type == "reasoning"
        assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.served
@pytest.mark.asyncio
async def test_messages_carry_the_reasoning_as_a_thinking_block(thinking_llm: LLMEngine) -> None:
    turns = [{"role": m["role"], "content": m["content"] if m["role"] == "user" else [
        {"type": "thinking", "thinking": m.get("reasoning_content") or m.get("reasoning"), "signature": "x"},
        {"type": "text", "text": m["content"]}]} for m in SHOTS]
    ask = {"model": MODEL, "messages": turns, "max_tokens": 24, "extra_body": {"temperature": 0}}
    async with serve(thinking_llm) as server:
        client = anthropic.AsyncAnthropic(base_url=str(server.test_server.make_url("")), api_key="unused",
                                          max_retries=0)
        whole = await client.messages.create(**ask)
        kinds = [block.type for block in whole.content]
        assert kinds[0] == "thinking" and whole.content[0].thinking.strip(), whole.content
        async with client.messages.stream(**ask) as stream:
            final = await stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
        # a thinking block sent back is rendered where the template reads the reasoning
        status, counted = await server.post("/v1/messages/count_tokens", {"model": MODEL, "messages": turns})
        plain = [{"role": m["role"], "content": m["content"]} for m in SHOTS]
        _, without = await server.post("/v1/messages/count_tokens", {"model": MODEL, "messages": plain})
        assert status == 200 and counted["input_tokens"] > without["input_tokens"], (counted, without)
