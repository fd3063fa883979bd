"""gpt-oss's chat format (api/conversation/harmony.py) against openai_harmony itself: the prompt
rendered from template dicts equals the library's rendering of the same conversation; an answer
written as harmony text and encoded with harmony's encoding parses into the same parts whole and
cut at every token boundary (analysis -> reasoning, a commentary call -> a tool call with its
arguments, final -> text); the forced-call grammar takes exactly harmony's call syntax; and the
vocabulary file is made from quicktok-v1's copy with harmony's sha256."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
from harmony_models import write_tokenizer
from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
                            ToolDescription)

from inferd.api.conversation.answer import (AnswerFormat, Finish, Reasoning, Text, ToolCallArguments, ToolCallStart,
                                            answer_format, decode_whole)
from inferd.api.conversation.harmony import HARMONY_ENDS, render, speaks_harmony
from inferd.api.conversation.render import render_prompt
from inferd.api.conversation.tool_grammar import tools_grammar
from inferd.engine.structured.grammar import GrammarCompiler
from inferd.model.loading.loader import default_model_path
from inferd.text import o200k
from inferd.text.o200k import harmony_encoding
from inferd.text.tokenizer import Tokenizer
from inferd.text.tokenizer_loader import load_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should look it up.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is 21 degrees."},
    {"role": "user", "content": "And the time?"},
]
ANSWERS = {
    "call": '<|channel|>analysis<|message|>The user wants the weather in Paris; call the tool.<|end|>'
            '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Paris", "unit": "c"}<|call|>',
    "final": "<|channel|>analysis<|message|>Simple question.<|end|>"
             "<|start|>assistant<|channel|>final<|message|>Paris is the capital of France — 巴黎.<|return|>",
    "preamble": "<|channel|>commentary<|message|>Let me check.<|end|>"
                "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
    "cut": "<|channel|>analysis<|message|>thinking, and then cut sh",
    "no header": "Plain text from a model that does not speak harmony.",
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("gpt-oss")))


def tokens(text: str) -> list[int]:
    return harmony_encoding().encode(text, allowed_special="all")


def expected_conversation(effort: ReasoningEffort) -> Conversation:
    """MESSAGES and the tools as openai_harmony's own objects, written by hand."""
    developer = (DeveloperContent.new().with_instructions("Answer briefly.").with_function_tools([
        ToolDescription.new("get_weather", "The weather in a city", WEATHER["function"]["parameters"]),
        ToolDescription.new("get_time", "", {"type": "object", "properties": {}})]))
    return Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(effort)),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, "I should look it up.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"temperature": 21}')
        .with_channel("commentary").with_recipient("assistant"),
        Message.from_role_and_content(Role.ASSISTANT, "It is 21 degrees.").with_channel("final"),
        Message.from_role_and_content(Role.USER, "And the time?"),
    ])


@pytest.mark.parametrize(("effort", "harmony_effort"), [(None, ReasoningEffort.MEDIUM), ("low", ReasoningEffort.LOW),
                                                         ("high", ReasoningEffort.HIGH), ("minimal", ReasoningEffort.LOW)])
def test_the_prompt_is_openai_harmonys_rendering(tokenizer: Tokenizer, effort: str | None,
                                                 harmony_effort: ReasoningEffort) -> None:
    expected = harmony_encoding().render_conversation_for_completion(expected_conversation(harmony_effort),
                                                                     Role.ASSISTANT)
    assert render(MESSAGES, [WEATHER, TIME], effort) == expected
    assert render_prompt(tokenizer, MESSAGES, [WEATHER, TIME], effort=effort) == expected
    text = tokenizer.decode(expected, skip_special_tokens=False)
    assert f"Reasoning: {harmony_effort.value.lower()}" in text and text.endswith("<|start|>assistant")
    assert "type get_weather = (_: {" in text and "<|start|>functions.get_weather to=assistant" in text


def test_a_plain_conversation_has_no_developer_message(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.decode(render_prompt(tokenizer, [{"role": "user", "content": "Hi"}], []), skip_special_tokens=False)
    assert "<|start|>developer" not in prompt and prompt.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")


def test_a_harmony_model_is_known_by_its_vocabulary(tokenizer: Tokenizer) -> None:
    assert speaks_harmony(tokenizer)
    assert not speaks_harmony(load_tokenizer(default_model_path()))
    answer = answer_format(tokenizer, render(MESSAGES, []), tools=True)
    assert answer.harmony and answer.reasoning is None and answer.stop_token_ids == HARMONY_ENDS


def gathered(parts: list) -> tuple[str, str, list[tuple[str, str]]]:
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
    text = "".join(p.text for p in parts if isinstance(p, Text))
    names = {p.index: p.name for p in parts if isinstance(p, ToolCallStart)}
    arguments = {i: "".join(p.fragment for p in parts if isinstance(p, ToolCallArguments) and p.index == i)
                 for i in names}
    return reasoning, text, [(names[i], arguments[i]) for i in sorted(names)]


HARMONY = AnswerFormat(tools=True, harmony=True)
WHOLE = {
    "call": ("The user wants the weather in Paris; call the tool.", "",
             [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    "final": ("Simple question.", "Paris is the capital of France — 巴黎.", []),
    "preamble": ("", "Let me check.", [("get_time", "{}")]),
    "cut": ("thinking, and then cut sh", "", []),
    "no header": ("", ANSWERS["no header"], []),
}


@pytest.mark.parametrize("name", list(ANSWERS))
def test_a_harmony_answer_parses_into_the_parts(tokenizer: Tokenizer, name: str) -> None:
    ids = tokens(ANSWERS[name])
    whole = decode_whole(tokenizer, HARMONY, "(the text is not read)", "stop", HARMONY_ENDS[0], ids)
    reasoning, text, calls = WHOLE[name]
    assert (whole.reasoning, whole.text) == (reasoning, text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls] == calls
    assert all(json.loads(arguments) is not None for _, arguments in calls)
    assert whole.finish == Finish("stop", HARMONY_ENDS[0], bool(calls))


@pytest.mark.parametrize("name", list(ANSWERS))
def test_every_cut_gives_the_whole_answer(tokenizer: Tokenizer, name: str) -> None:
    ids = tokens(ANSWERS[name])
    whole = HARMONY.decoder(tokenizer).feed("", True, "stop", None, ids)
    for cut in range(len(ids) + 1):
        decoder = HARMONY.decoder(tokenizer)
        parts = decoder.feed("", False, token_ids=ids[:cut]) + decoder.feed("", True, "stop", None, ids[cut:])
        assert gathered(parts) == gathered(whole), cut
        assert parts[-1] == whole[-1] and sum(isinstance(p, Finish) for p in parts) == 1
    decoder = HARMONY.decoder(tokenizer)
    one_by_one = [p for i in ids for p in decoder.feed("", token_ids=[i])] + decoder.feed("", True, "stop")
    assert gathered(one_by_one) == gathered(whole)
    kinds = [type(p) for p in one_by_one]
    if ToolCallStart in kinds:  # a call's start comes before its arguments, and after the reasoning
        assert kinds.index(ToolCallStart) < kinds.index(ToolCallArguments)
        assert Reasoning not in kinds[kinds.index(ToolCallStart):]


def test_without_tools_a_call_is_not_content(tokenizer: Tokenizer) -> None:
    whole = decode_whole(tokenizer, AnswerFormat(tools=False, harmony=True), "", "stop", None, tokens(ANSWERS["call"]))
    assert whole.text == "" and whole.calls == [] and not whole.finish.called and whole.reasoning


def test_a_message_without_its_start_token_still_parses(tokenizer: Tokenizer) -> None:
    ids = tokens("<|channel|>analysis<|message|>hm<|end|><|channel|>final<|message|>Yes.<|return|>")
    whole = decode_whole(tokenizer, HARMONY, "", "stop", None, ids)
    assert (whole.reasoning, whole.text) == ("hm", "Yes.")


def compiled(tokenizer: Tokenizer, name: str | None) -> object:
    grammar = tools_grammar(tokenizer, [WEATHER, TIME], forced=True, name=name, parallel=True, param="tool_choice")
    assert grammar is not None and grammar.kind == "tools"
    return GrammarCompiler(tokenizer).compile(grammar.text)


def takes(constraint: object, ids: list[int]) -> bool:
    matcher = constraint.matcher.deep_copy()  # type: ignore[attr-defined]
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_a_forced_call_is_harmonys_call_syntax(tokenizer: Tokenizer) -> None:
    weather = compiled(tokenizer, "get_weather")
    assert takes(weather, tokens(ANSWERS["call"]))
    direct = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>'
    assert takes(weather, tokens(direct))
    assert not takes(weather, tokens(ANSWERS["final"]))
    assert not takes(weather, tokens(direct.replace("get_weather", "get_time")))
    assert not takes(weather, tokens(direct.replace('"Rome"', "7")))  # (the parameters' schema holds)
    assert takes(compiled(tokenizer, None), tokens(direct.replace("get_weather", "get_time").replace(
        '{"city": "Rome"}', "{}")))
    assert tools_grammar(tokenizer, [WEATHER], forced=False, name=None, parallel=True, param="tools") is None


def test_the_vocabulary_file_is_made_from_the_package(tmp_path: Path) -> None:
    packed = struct.pack("<I", 2) + struct.pack("<H", 2) + b"hi" + struct.pack("<I", 1) \
        + struct.pack("<H", 1) + b"\n" + struct.pack("<I", 0)
    assert o200k.tiktoken_text(packed) == b"Cg== 0\naGk= 1\n"
    made = o200k.install(tmp_path)
    assert hashlib.sha256(made.read_bytes()).hexdigest() == o200k.SHA256
    assert o200k.install(tmp_path) == made  # (made once: the check finds it)
