"""The one answer decoder (api/conversation/answer.py) on made-up answers: any chunking of the same
text gives the same reasoning, content and calls as the whole answer, and the parts come in the
order the protocols render them (reasoning first, a call's start before its arguments, Finish last)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.api.conversation.answer import (AnswerFormat, Finish, Reasoning, Text, ToolCallArguments, ToolCallStart,
                                            decode_whole)
from inferd.api.conversation.reasoning import THINK, PromptReasoning
from inferd.api.conversation.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from inferd.model.loading.loader import default_model_path
from inferd.text.tokenizer import Tokenizer
from inferd.text.tokenizer_loader import load_tokenizer

THINKING = AnswerFormat(PromptReasoning(THINK, inside=False), tools=True)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


def call(name: str, arguments: dict) -> str:
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}) + TOOL_CALL_CLOSE


ANSWERS = [
    "<think>\nthe user wants the weather\n</think>\n\nLet me look." + call("weather", {"city": "Paris"}),
    "<think>\nplan</think>\n\n" + call("a", {"x": 1}) + "\n" + call("b", {"y": [1, 2]}),
    "<think>\nno call needed\n</think>\n\nParis is the capital.",
    "no reasoning at all, and a call: " + call("lookup", {"q": "<think>"}),
    "<think>\ncut short",
]


def streamed(tokenizer: Tokenizer, answer: AnswerFormat, chunks: list[str]) -> list:
    decoder = answer.decoder(tokenizer)
    parts = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        parts += decoder.feed(chunk, last, "stop" if last else None)
    return parts


def gathered(parts: list) -> tuple[str, str, list[tuple[int, str, str]]]:
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
    text = "".join(p.text for p in parts if isinstance(p, Text))
    names = {p.index: (p.id, p.name) for p in parts if isinstance(p, ToolCallStart)}
    arguments = {i: "".join(p.fragment for p in parts if isinstance(p, ToolCallArguments) and p.index == i)
                 for i in names}
    return reasoning, text, [(i, names[i][1], arguments[i]) for i in sorted(names)]


@settings(max_examples=60, deadline=None)
@given(which=st.integers(0, len(ANSWERS) - 1), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_chunking_gives_the_whole_answer(tokenizer: Tokenizer, which: int, cuts: list[int]) -> None:
    text = ANSWERS[which]
    points = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]
    parts = streamed(tokenizer, THINKING, chunks)
    whole = decode_whole(tokenizer, THINKING, text, "stop")
    reasoning, content, calls = gathered(parts)
    assert reasoning == whole.reasoning and content == whole.text
    assert [(name, args) for _, name, args in calls] == [(c["function"]["name"], c["function"]["arguments"])
                                                         for c in whole.calls]
    assert isinstance(parts[-1], Finish) and sum(isinstance(p, Finish) for p in parts) == 1
    assert parts[-1].called == bool(whole.calls) and whole.finish.reason == "stop"


def test_parts_come_in_rendering_order(tokenizer: Tokenizer) -> None:
    parts = THINKING.decoder(tokenizer).feed(ANSWERS[1], True, "stop")
    kinds = [type(p).__name__ for p in parts]
    assert kinds[0] == "Reasoning" and kinds[-1] == "Finish"
    assert kinds.index("ToolCallStart") < kinds.index("ToolCallArguments")
    fillers = [p for p in parts if isinstance(p, Text)]
    assert fillers and all(p.filler for p in fillers)  # only the newline between the calls: no content
    assert decode_whole(tokenizer, THINKING, ANSWERS[1], "stop").text == "\n"  # (a whole answer keeps it)


def test_an_answer_format_without_reasoning_or_tools_is_text(tokenizer: Tokenizer) -> None:
    plain = AnswerFormat()
    parts = plain.decoder(tokenizer).feed("<think>not a marker here</think> " + call("x", {}), True, "length")
    assert parts == [Text("<think>not a marker here</think> " + call("x", {})), Finish("length", None, False)]
