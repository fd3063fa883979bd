"""Tool calling's pure-Python part: the prompt, history rewriting, the grammar and the parser.

The grammar tests run llguidance against the default model's tokenizer (skipped without it).
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.api.conversation.tools import (
    MAX_PARALLEL_CALLS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Arguments,
    CallStart,
    Content,
    ToolCallParser,
    history_message,
    tools_system_prompt,
)
from inferd.api.conversation.tool_grammar import auto_call_grammar, tool_call_grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no description, no parameters
PARIS = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CLOCK_CALL = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


def parse(chunks: list[str]) -> tuple[list, list[dict]]:
    """All events and the calls from feeding `chunks` to a parser with ids call_0, call_1, ..."""
    counter = itertools.count()
    parser = ToolCallParser(id_factory=lambda: f"call_{next(counter)}")
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    return events, parser.calls


def content(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, Content))


def arguments(events: list, index: int) -> str:
    return "".join(e.fragment for e in events if isinstance(e, Arguments) and e.index == index)


def call(id_: str, name: str, args: str) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}


# ---------------------------------------------------------------------------------------------
# prompt and history


def test_system_prompt_lists_each_function_on_one_line() -> None:
    prompt = tools_system_prompt([WEATHER, CLOCK])
    listed = prompt.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in listed] == [WEATHER["function"], CLOCK["function"]]
    assert '<tool_call>{"name": "<function-name>", "arguments": {' in prompt
    assert "answer normally" in prompt


def test_history_assistant_tool_calls_become_text() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            call("call_1", "get_weather", '{"city": "Paris"}'),
            call("call_2", "get_time", "not json"),
        ],
    }
    text = history_message(message)["content"]
    assert text == PARIS + '\n<tool_call>{"name": "get_time", "arguments": "not json"}</tool_call>'
    with_content = history_message({**message, "content": "Let me check. "})["content"]
    assert with_content.startswith("Let me check. " + PARIS)


def test_history_tool_result_and_other_messages() -> None:
    tool = {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}
    expected = {"role": "tool", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    assert history_message(tool) == expected
    user = {"role": "user", "content": "hi", "name": "ann", "extra": 1}
    assert history_message(user) == {"role": "user", "content": "hi", "name": "ann"}
    parts = {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert history_message(parts)["content"] == "<tool_response>\nab\n</tool_response>"


def test_history_round_trips_through_the_parser() -> None:
    """What the model sees of its earlier calls is what the parser reads as those calls."""
    calls = [call("call_0", "get_weather", '{"city": "Paris"}')]
    message = {"role": "assistant", "content": "", "tool_calls": calls}
    events, calls = parse([history_message(message)["content"]])
    assert calls == message["tool_calls"] and content(events) == ""


# ---------------------------------------------------------------------------------------------
# grammar, checked by llguidance against the default model's tokenizer


class LLGuidanceTokenizer:
    """What llguidance's TokenizerWrapper wants from a tokenizer: byte strings per id, an encoder."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.eos_token_id = min(tok.eos_token_ids)
        self.bos_token_id = tok.bos_token_id
        self.special_token_ids = sorted(tok.special_ids)
        # NOTE: llguidance marks special tokens by a leading 0xff byte (never valid UTF-8)
        self.tokens = [
            b"\xff" + tok.id_to_token(i).encode() if i in tok.special_ids else tok.token_bytes(i)
            for i in range(tok.vocab_size)
        ]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("encode takes str")  # tells TokenizerWrapper to pass str, not bytes
        return self._tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def tokenizer():
    from inferd.text.errors import ModelLoadError
    from inferd.model.loading.loader import default_model_path
    from inferd.text.tokenizer_loader import load_tokenizer

    try:
        return load_tokenizer(default_model_path())
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def matcher(tokenizer):
    llguidance = pytest.importorskip("llguidance")
    wrapper = llguidance.TokenizerWrapper(LLGuidanceTokenizer(tokenizer))
    ll_tokenizer = llguidance.LLTokenizer(wrapper, eos_token=sorted(tokenizer.eos_token_ids))

    def accepts(grammar: str, text: str) -> bool:
        lark = llguidance.LLMatcher.grammar_from_lark(grammar)
        assert llguidance.LLMatcher.validate_grammar(lark) == ""
        m = llguidance.LLMatcher(ll_tokenizer, lark)
        return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()

    return accepts


def test_grammar_forces_the_named_function(matcher) -> None:
    grammar = tool_call_grammar([CLOCK, WEATHER], "get_weather", parallel=False)
    assert matcher(grammar, PARIS)
    assert matcher(grammar, PARIS.replace('"Paris"}', '"Paris", "days": 3}'))
    assert not matcher(grammar, PARIS.replace("get_weather", "get_wether"))
    assert not matcher(grammar, CLOCK_CALL)
    assert not matcher(grammar, PARIS.replace('"city"', '"town"'))  # "city" is required
    assert not matcher(grammar, "Paris is sunny.")
    assert not matcher(grammar, PARIS + "\n" + PARIS)  # not parallel


def test_grammar_any_function_and_parallel(matcher) -> None:
    grammar = tool_call_grammar([WEATHER, CLOCK], None, parallel=True)
    assert matcher(grammar, PARIS)
    assert matcher(grammar, CLOCK_CALL)
    assert matcher(grammar, PARIS + "\n" + CLOCK_CALL + "\n" + PARIS)
    assert not matcher(grammar, PARIS + CLOCK_CALL)  # calls are separated by "\n"
    assert not matcher(grammar, '<tool_call>{"name": "get_time", "arguments": []}</tool_call>')
    assert matcher(grammar, "\n".join([PARIS] * MAX_PARALLEL_CALLS))
    assert not matcher(grammar, "\n".join([PARIS] * (MAX_PARALLEL_CALLS + 1)))  # a bounded answer


def test_grammar_pins_the_json_layout(matcher) -> None:
    """Only json.dumps' layout: a model cannot wander off into endless whitespace."""
    grammar = tool_call_grammar([WEATHER], "get_weather", parallel=False)
    assert not matcher(grammar, PARIS.replace('{"city": ', '{\n  "city": '))
    assert not matcher(grammar, PARIS.replace('{"city": ', '{"city":'))
    # NOTE: llguidance also keeps properties in the schema's order (whatever the layout options)
    assert not matcher(grammar, PARIS.replace('{"city": "Paris"}', '{"days": 1, "city": "Paris"}'))


def test_grammar_survives_awkward_schemas(matcher) -> None:
    odd = {
        "type": "function",
        "function": {
            "name": "odd-name_2",
            "parameters": {
                "type": "object",
                "description": 'quotes " and \\ and // and # and } { and \n newline',
                "properties": {"when": {"type": "string", "format": "no-such-format"}},
            },
        },
    }
    grammar = tool_call_grammar([odd], None, parallel=False)
    assert matcher(grammar, '<tool_call>{"name": "odd-name_2", "arguments": {"when": "now"}}</tool_call>')


def test_auto_grammar_leaves_text_free_and_holds_calls(matcher) -> None:
    grammar = auto_call_grammar([WEATHER, CLOCK], parallel=True)
    assert matcher(grammar, "Paris is sunny. <tool and a < b\n{}")
    assert matcher(grammar, "")
    assert matcher(grammar, "Let me look. " + PARIS + "\nAnd the time: " + CLOCK_CALL + " Done.")
    assert not matcher(grammar, "Let me look. <tool_call>Paris</tool_call>")
    assert not matcher(grammar, PARIS.replace("get_weather", "get_wether"))
    assert not matcher(grammar, PARIS.replace('"city"', '"town"'))  # "city" is required
    assert not matcher(grammar, PARIS.replace('{"city": ', '{\n  "city": '))  # the prompt's layout
    assert not matcher(grammar, "<tool_call></tool_call>")
    assert matcher(grammar, " ".join([PARIS] * MAX_PARALLEL_CALLS))
    assert not matcher(grammar, " ".join([PARIS] * MAX_PARALLEL_CALLS) + " <tool_call>")  # bounded


def test_auto_grammar_without_parallel_calls_opens_one(matcher) -> None:
    grammar = auto_call_grammar([WEATHER], parallel=False)
    assert matcher(grammar, "Sure. " + PARIS + " That is all.")
    assert not matcher(grammar, PARIS + " " + PARIS)


def test_auto_grammar_for_a_template_that_puts_calls_on_lines(matcher) -> None:
    """Qwen's template shows <tool_call>\n{...}\n</tool_call>: its newlines are allowed."""
    grammar = auto_call_grammar([WEATHER], parallel=True, newlines=True)
    assert matcher(grammar, PARIS.replace("<tool_call>", "<tool_call>\n").replace("</tool_call>", "\n</tool_call>"))
    assert matcher(grammar, PARIS)


def test_grammar_refuses_unknown_names() -> None:
    with pytest.raises(ValueError, match="get_time"):
        tool_call_grammar([WEATHER], "get_time", parallel=False)
    with pytest.raises(ValueError):
        tool_call_grammar([], None, parallel=True)


# ---------------------------------------------------------------------------------------------
# parser


def test_plain_text() -> None:
    events, calls = parse(["Hello, ", "world."])
    assert events == [Content("Hello, "), Content("world.")] and calls == []


def test_text_then_call() -> None:
    events, calls = parse(["Let me look. " + PARIS])
    assert events == [
        Content("Let me look. "),
        CallStart(0, "call_0", "get_weather"),
        Arguments(0, '{"city": "Paris"}'),
    ]
    assert calls == [call("call_0", "get_weather", '{"city": "Paris"}')]


def test_two_calls_separated_by_a_newline() -> None:
    events, calls = parse([PARIS + "\n" + CLOCK_CALL])
    assert calls == [call("call_0", "get_weather", '{"city": "Paris"}'), call("call_1", "get_time", "{}")]
    assert content(events) == "\n"
    assert [e.index for e in events if isinstance(e, CallStart)] == [0, 1]


def test_exact_format_streams_arguments_before_the_close_tag() -> None:
    counter = itertools.count()
    parser = ToolCallParser(id_factory=lambda: f"call_{next(counter)}")
    seen: list = []
    for i, char in enumerate(PARIS):
        for event in parser.feed(char):
            seen.append((i, event))
    seen += [(len(PARIS), e) for e in parser.finish()]
    header_end = PARIS.index('"arguments": ') + len('"arguments": ')
    # the call starts with the "{" that opens its arguments
    assert seen[0] == (header_end, CallStart(0, "call_0", "get_weather"))
    fragments = [(i, e) for i, e in seen if isinstance(e, Arguments)]
    assert len(fragments) > 5 and fragments[-1][0] < PARIS.index(TOOL_CALL_CLOSE)
    # the arguments' own "}" goes out once the wrapper's "}" follows it; that one is held back
    assert fragments[-1] == (PARIS.index(TOOL_CALL_CLOSE) - 1, Arguments(0, "}"))
    assert arguments([e for _, e in seen], 0) == '{"city": "Paris"}'
    assert not any(isinstance(e, Content) for _, e in seen)
    assert parser.calls == [call("call_0", "get_weather", '{"city": "Paris"}')]


def test_free_form_block_is_parsed_whole() -> None:
    events, calls = parse(['<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>'])
    assert events == [CallStart(0, "call_0", "f"), Arguments(0, '{"a": 1}')]
    assert calls == [call("call_0", "f", '{"a": 1}')]


def test_free_form_block_with_string_arguments_and_spacing() -> None:
    events, calls = parse(['<tool_call>\n{"name":"f","arguments":"{\\"a\\": 1}"}\n</tool_call>'])
    assert calls == [call("call_0", "f", '{"a": 1}')] and content(events) == ""


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "{broken"}</tool_call>',
    ],
)
def test_broken_block_becomes_content(block: str) -> None:
    events, calls = parse(["a ", block, " b"])
    assert content(events) == "a " + block + " b" and calls == []


def test_unterminated_block_becomes_content() -> None:
    text = 'Sure <tool_call>{"arguments": {"a": 1}, "name": "f"}'
    events, calls = parse([text])
    assert content(events) == text and calls == []


def test_a_repeated_call_is_dropped_and_never_streamed() -> None:
    rome = PARIS.replace("Paris", "Rome")
    text = PARIS + "\n" + PARIS + "\n" + rome + "\n" + rome
    events, calls = parse(list(text))  # a character at a time: the repeat is held back, then dropped
    assert calls == [call("call_0", "get_weather", '{"city": "Paris"}'), call("call_2", "get_weather", '{"city": "Rome"}')]
    assert [e.index for e in events if isinstance(e, CallStart)] == [0, 1]
    assert arguments(events, 0) == '{"city": "Paris"}' and arguments(events, 1) == '{"city": "Rome"}'
    assert content(events) == "\n\n\n"


def test_a_call_that_starts_like_an_earlier_one_streams_once_it_differs() -> None:
    longer = PARIS.replace('"Paris"}', '"Paris", "days": 2}')
    counter = itertools.count()
    parser = ToolCallParser(id_factory=lambda: f"call_{next(counter)}")
    parser.feed(PARIS)
    assert parser.feed(longer[: longer.index("Paris")]) == []  # held: it may still be a repeat
    out = parser.feed('Paris", ')
    assert out[0] == CallStart(1, "call_1", "get_weather") and arguments(out, 1) == '{"city": "Paris",'


def test_free_form_repeats_are_dropped_too() -> None:
    block = '<tool_call> {"name": "get_time", "arguments": {}} </tool_call>'
    _, calls = parse([block, CLOCK_CALL, block])
    assert calls == [call("call_0", "get_time", "{}")]


def test_streamed_call_cut_off_keeps_what_was_written() -> None:
    """Its CallStart and fragments went out already, so it stays a call (as with max_tokens)."""
    events, calls = parse(['<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_'])
    assert calls == [call("call_0", "f", '{"a": 1}')] and arguments(events, 0) == '{"a": 1}'
    events, calls = parse(['<tool_call>{"name": "f", "arguments": {"a": '])
    assert calls == [call("call_0", "f", '{"a": ')] and arguments(events, 0) == '{"a": '


def test_partial_open_tag_at_the_end_is_released_at_finish() -> None:
    counter = itertools.count()
    parser = ToolCallParser(id_factory=lambda: f"call_{next(counter)}")
    assert parser.feed("Hello <tool") == [Content("Hello ")]
    assert parser.finish() == [Content("<tool")]


@pytest.mark.parametrize("text", ["a < b", "x <tool> y", "<tool_cal l>", "<<tool_call>", "1 <tool"])
def test_text_with_lookalike_tags(text: str) -> None:
    events, calls = parse(list(text))
    assert content(events) == text and calls == []


# ---------------------------------------------------------------------------------------------
# any chunking of the same text gives the same content and calls

PIECES = [
    "Hello",
    " ",
    "\n",
    "<",
    "<tool",
    "}",
    '"',
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    PARIS,
    CLOCK_CALL,
    '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "}</tool"}]} }</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # wrapper "}" missing
    '<tool_call> {"arguments": {"a": 1}, "name": "g"} </tool_call>',
    "<tool_call>{broken</tool_call>",
    '<tool_call>{"name": "a</tool_call>", "arguments": {}}</tool_call>',
    '{"name": "f", "arguments": ',
]


@st.composite
def chunked_text(draw, pieces: list[str]) -> tuple[str, list[str]]:
    """A text of up to 8 `pieces`, and the same text cut at up to 12 places."""
    text = "".join(draw(st.lists(st.sampled_from(pieces), max_size=8)))
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds) if a < b]


@settings(max_examples=400, deadline=None)
@given(chunked_text(PIECES))
def test_any_chunking_gives_the_same_result(case: tuple[str, list[str]]) -> None:
    text, chunks = case
    whole_events, whole_calls = parse([text])
    events, calls = parse(chunks)
    assert content(events) == content(whole_events)
    assert calls == whole_calls
    for i, c in enumerate(calls):
        assert arguments(events, i) == c["function"]["arguments"]
    if "<tool_call>" not in text:
        assert content(events) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([PARIS, CLOCK_CALL, "\n", "Hi. "]), max_size=6))
def test_well_formed_calls_have_json_arguments(pieces: list[str]) -> None:
    events, calls = parse(list("".join(pieces)))
    assert len(calls) == len({p for p in pieces if p in (PARIS, CLOCK_CALL)})  # each call once
    for c in calls:
        json.loads(c["function"]["arguments"])
    assert content(events) == "".join(p for p in pieces if p not in (PARIS, CLOCK_CALL))


# ---------------------------------------------------------------------------------------------
# Llama-3's format: the whole answer is one call


def test_the_format_is_read_from_the_template() -> None:
    from types import SimpleNamespace

    from inferd.api.conversation.tool_formats import HERMES, LLAMA3_JSON, tool_format

    def form(template: str | None) -> str | None:
        return tool_format(SimpleNamespace(chat_template=template))  # type: ignore[arg-type]

    assert form(None) == form("{{ messages }}") == HERMES  # no tools in the template: we teach Hermes
    assert form("{% if tools %}<tool_call>\n{{ tools }}{% endif %}") == HERMES  # Qwen's, Hermes'
    llama = '{% if tools %}Respond in the format {"name": function name, "parameters": dictionary of ...{% endif %}'
    assert form(llama) == LLAMA3_JSON
    assert form("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]{% endif %}") is None  # Mistral's: not yet


def test_llama3_grammar_free_text_or_one_call(matcher) -> None:
    from inferd.api.conversation.tool_grammar import llama3_grammar

    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    auto = llama3_grammar([WEATHER, CLOCK], None, forced=False)
    assert matcher(auto, "It is sunny {maybe}.") and matcher(auto, "") and matcher(auto, call)
    assert matcher(auto, "\n " + call)
    assert not matcher(auto, '{"name": "get_wether", "parameters": {"city": "Paris"}}')
    assert not matcher(auto, '{"name": "get_weather", "parameters": {"town": "Paris"}}')
    assert not matcher(auto, call + " and more")  # the call is the whole answer
    forced = llama3_grammar([WEATHER, CLOCK], "get_weather", forced=True)
    assert matcher(forced, call) and not matcher(forced, "Sunny.")
    assert not matcher(forced, '{"name": "get_time", "parameters": {}}')


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_llama3_answers_parse_whole_in_any_chunking(size: int) -> None:
    from inferd.api.conversation.tool_formats import JsonAnswerParser

    def run(text: str) -> tuple[list, list[dict]]:
        parser = JsonAnswerParser(id_factory=lambda: "call_0")
        events = [e for i in range(0, len(text), size) for e in parser.feed(text[i : i + size])] + parser.finish()
        return events, parser.calls

    events, calls = run(' {"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert calls == [call("call_0", "get_weather", '{"city": "Paris"}')] and content(events) == ""
    assert events[0] == CallStart(0, "call_0", "get_weather")
    events, calls = run("Sunny, {probably}.")
    assert calls == [] and content(events) == "Sunny, {probably}."
    events, calls = run('{"broken": ')
    assert calls == [] and content(events) == '{"broken": '
