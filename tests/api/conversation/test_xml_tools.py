"""Qwen3.5's XML tool calls (the "qwen3_xml" format of tool_formats.py): read from the template,
parsed in any chunking with values typed by the schema, held by the grammars of tool_grammar.py.

The grammar tests run llguidance against the default model's tokenizer (test_tools' fixtures).
"""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from test_tools import chunked_text, matcher, tokenizer  # noqa: F401  (the fixtures)

from inferd.api.conversation.answer import AnswerFormat, decode_whole
from inferd.api.conversation.reasoning import THINK, PromptReasoning
from inferd.api.conversation.tool_formats import (
    HERMES,
    QWEN3_XML,
    XmlCallParser,
    parameter_value,
    tool_format,
    tool_parser,
)
from inferd.api.conversation.tool_grammar import (
    tools_grammar,
    xml_auto_grammar,
    xml_call_grammar,
)
from inferd.api.conversation.tools import (
    MAX_PARALLEL_CALLS,
    Arguments,
    CallStart,
    Content,
    ToolCallParser,
)
from inferd.text.chat_template import render_chat_template

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "note": {"type": "string", "maxLength": 5}, "options": {"type": "object", "properties": {
            "hourly": {"type": "boolean"}}}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters
ANY = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}  # any names
TYPED = {"type": "function", "function": {"name": "typed", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}, "z": {"type": "null"},
    "maybe": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "free": {}}}}}

# Qwen3.5's template: a line of its tool instructions, and its rendering of earlier calls
QWEN35_CALLS = """{%- if tools %}<tools>{{ tools | tojson }}</tools>
<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>
</function>\n</tool_call>{%- endif %}
{%- for message in messages %}{%- for call in message.tool_calls or [] %}{%- set call = call.function %}\
{%- if not loop.first %}{{- '\\n' }}{%- endif %}{{- '<tool_call>\\n<function=' + call.name + '>\\n' }}\
{%- for name, value in call.arguments|items %}{{- '<parameter=' + name + '>\\n' }}\
{%- set value = value | tojson | safe if value is mapping or (value is sequence and value is not string) \
else value | string %}{{- value }}{{- '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}\
{%- endfor %}{%- endfor %}"""


def xml(name: str, **values: str) -> str:
    """A call as the template writes it, each value's text given."""
    parameters = "".join(f"<parameter={key}>\n{text}\n</parameter>\n" for key, text in values.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


PARIS = xml("get_weather", city="Paris", days="3")
CLOCK_CALL = xml("get_time")


def parse(chunks: list[str], tools: list[dict] | None = None) -> tuple[list, list[dict]]:
    """All events and the calls from feeding `chunks` to a parser with ids call_0, call_1, ..."""
    counter = itertools.count()
    parser = XmlCallParser([WEATHER, CLOCK, TYPED] if tools is None else tools,
                           id_factory=lambda: f"call_{next(counter)}")
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    return events, parser.calls


def content(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, Content))


def call(id_: str, name: str, arguments: dict[str, Any]) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def templated(template: str) -> Any:
    return SimpleNamespace(chat_template=template, vocab_size=0)  # (vocab_size: it speaks no harmony)


# ---------------------------------------------------------------------------------------------
# the format, read from the template


def test_the_xml_format_is_read_from_the_template() -> None:
    assert tool_format(templated(QWEN35_CALLS)) == QWEN3_XML  # before Hermes: it shows <tool_call> too
    assert tool_format(templated("{% if tools %}<tool_call>\n{{ tools }}{% endif %}")) == HERMES  # Qwen3's
    assert tool_format(templated("{{ messages }} <function=")) == HERMES  # no tools: we teach Hermes
    seed = "{{ tools }}<seed:tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>"
    assert tool_format(templated(seed)) is None  # another XML: not known here
    assert isinstance(tool_parser(templated(QWEN35_CALLS)), XmlCallParser)
    assert isinstance(tool_parser(templated("{{ tools }}<tool_call>")), ToolCallParser)


def test_tools_grammar_picks_the_xml_grammars() -> None:
    tok = templated(QWEN35_CALLS)
    forced = tools_grammar(tok, [WEATHER], forced=True, name=None, parallel=True, param="tool_choice")
    assert forced is not None and "<function=get_weather>" in forced.text and forced.kind == "tools"
    assert forced.repeat_tags == ("<tool_call>", "</tool_call>")
    auto = tools_grammar(tok, [WEATHER], forced=False, name=None, parallel=True, param="tools")
    assert auto is not None and auto.kind == "tools_auto" and auto.best_effort and not auto.ends_answer
    assert "<function=get_weather>" in auto.text
    with pytest.raises(ValueError, match="get_time"):
        tools_grammar(tok, [WEATHER], forced=True, name="get_time", parallel=False, param="tool_choice")


# ---------------------------------------------------------------------------------------------
# parsing


def test_text_then_calls_with_values_typed_by_the_schema() -> None:
    events, calls = parse(["Let me look.\n\n" + PARIS + "\n" + CLOCK_CALL + " Done."])
    assert calls == [call("call_0", "get_weather", {"city": "Paris", "days": 3}), call("call_1", "get_time", {})]
    assert events[:3] == [Content("Let me look.\n\n"), CallStart(0, "call_0", "get_weather"),
                          Arguments(0, '{"city": "Paris", "days": 3}')]
    assert content(events) == "Let me look.\n\n\n Done."


@pytest.mark.parametrize("key, text, value", [
    ("s", "Paris", "Paris"), ("s", "42", "42"), ("s", "true", "true"), ("s", "\nline\n", "\nline\n"),
    ("s", "", ""), ("i", "42", 42), ("i", "forty", "forty"), ("n", "2.5", 2.5), ("b", "true", True),
    ("b", "False", False), ("o", '{"a": [1, 2]}', {"a": [1, 2]}), ("a", "[1, \"x\"]", [1, "x"]),
    ("a", "[1,", "[1,"), ("z", "null", None), ("maybe", "null", None), ("maybe", "12", "12"),
    ("free", "12", 12), ("free", "Paris", "Paris"), ("undeclared", '{"k": 1}', {"k": 1}),
])
def test_values_follow_the_parameter_schema(key: str, text: str, value: Any) -> None:
    """vLLM's qwen3_coder reading: one newline stripped each side, a string as it is, any other
    type as JSON (the text when that fails), an untyped or undeclared value as JSON or text."""
    _, calls = parse([xml("typed", **{key: text})])
    assert json.loads(calls[0]["function"]["arguments"]) == {key: value}
    assert parameter_value("\n\nkept\n\n", {"type": "string"}) == "\nkept\n"


def test_without_schemas_values_are_json_or_text() -> None:
    _, calls = parse([xml("get_weather", city="Paris", days="3", zip="75001")], tools=[])
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3, "zip": 75001}


@pytest.mark.parametrize("block", [
    "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",  # Hermes' JSON
    "<tool_call>\n<function=get_time>\n</tool_call>",  # no </function>
    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",  # no </parameter>
    "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
    "<tool_call>\n<function=f>\n</function>\n<function=g>\n</function>\n</tool_call>",
    "<tool_call></tool_call>",
])
def test_a_block_that_does_not_parse_is_content(block: str) -> None:
    events, calls = parse(["a ", block, " b"])
    assert calls == [] and content(events) == "a " + block + " b"


def test_an_unclosed_block_is_a_call_when_its_function_is_whole() -> None:
    """Cut off before </tool_call> (max_tokens, a stop): a whole function still counts."""
    events, calls = parse(["Sure. " + PARIS.removesuffix("</tool_call>")])
    assert calls == [call("call_0", "get_weather", {"city": "Paris", "days": 3})] and content(events) == "Sure. "
    cut = "Sure. " + PARIS[:60]
    events, calls = parse([cut])
    assert calls == [] and content(events) == cut


def test_a_repeated_call_is_dropped() -> None:
    rome = xml("get_weather", city="Rome")
    events, calls = parse(list("\n".join([PARIS, PARIS, rome, xml("get_weather", city="Paris", days="3.0"), rome])))
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris", "days": 3}', '{"city": "Rome"}',
                                                          '{"city": "Paris", "days": 3.0}']
    assert [e.index for e in events if isinstance(e, CallStart)] == [0, 1, 2] and content(events) == "\n" * 4


def test_values_may_hold_markup_but_not_the_parameter_close() -> None:
    code = "<div>\n</function>\n<tool_call>\n</div>"
    _, calls = parse([xml("typed", s=code)])
    assert json.loads(calls[0]["function"]["arguments"]) == {"s": code}


def test_the_templates_calls_parse_back_to_the_history() -> None:
    """What the template writes of earlier calls is what the parser reads as those calls."""
    arguments = [{"city": "Paris", "days": 3, "options": {"hourly": True}}, {}]
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}}
        for name, args in zip(["get_weather", "get_time"], arguments, strict=True)]}]
    text = render_chat_template(QWEN35_CALLS, history, add_generation_prompt=False)
    _, calls = parse([text])
    assert [json.loads(c["function"]["arguments"]) for c in calls] == arguments


def test_the_answer_decoder_reads_xml_calls_after_reasoning() -> None:
    answer = "<think>\nask the tool\n</think>\n\n" + PARIS
    whole = decode_whole(templated(QWEN35_CALLS), AnswerFormat(PromptReasoning(THINK, inside=False), tools=True),
                         answer, "stop")
    assert whole.reasoning.strip() == "ask the tool" and whole.finish.called
    # (the front-ends give the parser no tools yet: values are read as JSON or text)
    assert [c["function"]["arguments"] for c in whole.calls] == ['{"city": "Paris", "days": 3}']


# any chunking of the same text gives the same content and calls

PIECES = ["Hello", " ", "\n", "<", "<tool", "<tool_call>", "</tool_call>", "<function=", "</parameter>", PARIS,
          CLOCK_CALL, xml("typed", s="a </tool_call> b", o='{"k": "<"}'), xml("typed", s="x", i="y"),
          "<tool_call>\n<function=get_time>\n", "<tool_call>junk</tool_call>", PARIS.removesuffix("</tool_call>")]


@settings(max_examples=300, deadline=None)
@given(chunked_text(PIECES))
def test_any_chunking_gives_the_same_result(case: tuple[str, list[str]]) -> None:
    text, chunks = case
    whole_events, whole_calls = parse([text])
    events, calls = parse(chunks)
    assert content(events) == content(whole_events) and calls == whole_calls
    for i, c in enumerate(calls):
        assert "".join(e.fragment for e in events if isinstance(e, Arguments) and e.index == i) == \
            c["function"]["arguments"]
    if "<tool_call>" not in text:
        assert content(events) == text


# ---------------------------------------------------------------------------------------------
# grammars, checked by llguidance against the default model's tokenizer


def test_forced_grammar_holds_calls_to_declared_functions_and_parameters(matcher) -> None:  # noqa: F811
    grammar = xml_call_grammar([WEATHER, CLOCK, ANY], None, parallel=False)
    assert matcher(grammar, PARIS) and matcher(grammar, CLOCK_CALL)
    assert matcher(grammar, xml("get_weather", city="Pa\nris </function>", days="3", unit="celsius", note="short",
                                options='{"hourly": true}'))
    assert matcher(grammar, xml("get_weather", city="Paris", options='{"hourly": false}'))  # optional ones skipped
    assert matcher(grammar, xml("note", anything="1", goes="x"))  # declares no properties
    assert not matcher(grammar, PARIS.replace("get_weather", "get_wether"))  # undeclared function
    assert not matcher(grammar, xml("get_weather", city="Paris", town="Rome"))  # undeclared parameter
    assert not matcher(grammar, xml("get_time", city="Paris"))  # no parameters
    assert not matcher(grammar, xml("get_weather", days="3"))  # city is required
    assert not matcher(grammar, xml("get_weather", days="3", city="Paris"))  # the schema's order
    assert not matcher(grammar, xml("get_weather", city="Paris", days="three"))  # an integer, as JSON
    assert not matcher(grammar, xml("get_weather", city="Paris", unit="kelvin"))  # the enum
    assert not matcher(grammar, xml("get_weather", city="Paris", note="too long"))  # maxLength
    assert not matcher(grammar, xml("get_weather", city="a</parameter>b"))
    assert not matcher(grammar, xml("get_weather", city="Paris", options='{"hourly":true}'))  # the layout
    assert not matcher(grammar, "Sure. " + PARIS)
    assert not matcher(grammar, PARIS + "\n" + CLOCK_CALL)  # not parallel


def test_forced_grammar_for_a_named_function_and_parallel_calls(matcher) -> None:  # noqa: F811
    named = xml_call_grammar([CLOCK, WEATHER], "get_weather", parallel=True)
    assert matcher(named, PARIS) and not matcher(named, CLOCK_CALL)
    assert matcher(named, "\n".join([PARIS] * MAX_PARALLEL_CALLS))
    assert not matcher(named, "\n".join([PARIS] * (MAX_PARALLEL_CALLS + 1)))  # a bounded answer
    assert not matcher(named, PARIS + PARIS)  # calls are separated by "\n"
    typed = xml_call_grammar([TYPED], None, parallel=False)
    assert matcher(typed, xml("typed", s="x", i="-4", n="2.5", b="True", o='{"a": 1}', a="[1, 2]", z="null",
                              maybe="null", free="anything"))
    assert not matcher(typed, xml("typed", b="yes"))


def test_the_templates_calls_are_what_the_forced_grammar_allows(matcher) -> None:  # noqa: F811
    history = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 3, "options": {"hourly": False}}}}]}]
    text = render_chat_template(QWEN35_CALLS, history, add_generation_prompt=False)
    assert matcher(xml_call_grammar([WEATHER], None, parallel=False), text)


def test_auto_grammar_leaves_text_free_and_holds_calls(matcher) -> None:  # noqa: F811
    grammar = xml_auto_grammar([WEATHER, CLOCK], parallel=True)
    assert matcher(grammar, "") and matcher(grammar, "It is sunny <function=x> a < b.")
    assert matcher(grammar, "Let me look.\n\n" + PARIS + "\nand " + CLOCK_CALL + " Done.")
    assert not matcher(grammar, "Let me look. <tool_call>\nParis</tool_call>")
    assert not matcher(grammar, xml("get_wether", city="Paris"))
    assert not matcher(grammar, xml("get_weather", town="Paris"))
    assert not matcher(grammar, " ".join([PARIS] * MAX_PARALLEL_CALLS) + " <tool_call>")  # bounded
    assert not matcher(xml_auto_grammar([WEATHER], parallel=False), PARIS + " " + PARIS)
