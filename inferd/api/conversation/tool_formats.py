"""Which tool-call format a model speaks, read from its chat template, and the parser for it.

    "hermes"       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, anywhere in the text:
                   what we teach a template without tools (tools.py), and what Hermes and Qwen
                   (up to Qwen3) templates show
    "qwen3_xml"    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
                   </function>\\n</tool_call>, anywhere in the text: Qwen3.5, Qwen3.6 and
                   Qwen3-Coder templates (vLLM's and SGLang's "qwen3_coder"); a string VALUE is
                   raw text, any other JSON value is written as JSON
    "llama3_json"  the whole answer is one call, {"name": ..., "parameters": {...}}: Llama 3.1-3.3
                   templates ("Respond in the format {"name": function name, "parameters": ...")
    None           a template with a format of its own not known here (Mistral's [TOOL_CALLS] is a
                   control token the detokenizer drops): "auto" runs free, forced calls use Hermes

tool_grammar.py builds each format's grammars; the front-ends parse answers with `tool_parser`.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from inferd.api.conversation.render import takes_tools
from inferd.api.conversation.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Arguments,
    CallStart,
    Content,
    Event,
    ToolCallParser,
    partial_tag,
    parse_call,
)
from inferd.text.tokenizer import Tokenizer

HERMES, QWEN3_XML, LLAMA3_JSON = "hermes", "qwen3_xml", "llama3_json"
LLAMA3_MARKER = '{"name": function name, "parameters": '  # the instruction Llama 3.1-3.3 templates carry
# Qwen3.5's XML call, as its template writes one (and its tool instructions show)
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"


def tool_format(tokenizer: Tokenizer) -> str | None:
    """The tool-call format of the model's chat template (the module's docstring lists them)."""
    template = tokenizer.chat_template or ""
    if not takes_tools(tokenizer):
        return HERMES
    if TOOL_CALL_OPEN in template:  # (Seed-OSS's XML calls sit in <seed:tool_call>: not these)
        return QWEN3_XML if FUNCTION_OPEN in template and PARAMETER_OPEN in template else HERMES
    if LLAMA3_MARKER in template:
        return LLAMA3_JSON
    return None


def tool_parser(tokenizer: Tokenizer, id_factory: Callable[[], str] | None = None,
                tools: Sequence[dict] | None = None) -> ToolParser:
    """A parser of the model's answers for its format (Hermes where it has none we know). The
    `tools` offered (OpenAI tool or function dicts) type the XML format's parameter values."""
    form = tool_format(tokenizer)
    if form == LLAMA3_JSON:
        return JsonAnswerParser(id_factory)
    if form == QWEN3_XML:
        return XmlCallParser(tools, id_factory)
    return ToolCallParser(id_factory)


class JsonAnswerParser:
    """Llama-3's format: an answer whose first non-blank character is "{" is one call, read whole
    at its end (its arguments come in one piece); any other answer is text. Under the grammar
    (tool_grammar.py) such an answer is always a valid call; one that does not parse is text."""

    def __init__(self, id_factory: Callable[[], str] | None = None) -> None:
        self._new_id = id_factory or (lambda: "call_" + secrets.token_hex(12))
        self._buffer = ""
        self._is_call: bool | None = None  # undecided while the answer is blank
        self.calls: list[dict] = []

    @property
    def calls_started(self) -> int:
        return 1 if self._is_call else 0

    def feed(self, text: str) -> list[Event]:
        if self._is_call is False:
            return [Content(text)] if text else []
        self._buffer += text
        if self._is_call is None and self._buffer.strip():
            self._is_call = self._buffer.lstrip().startswith("{")
            if not self._is_call:
                text, self._buffer = self._buffer, ""
                return [Content(text)]
        return []

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        call = parse_call(text) if self._is_call else None
        if call is None:
            self._is_call = False
            return [Content(text)] if text else []
        call.id = self._new_id()
        self.calls.append({"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}})
        return [CallStart(0, call.id, call.name), Arguments(0, call.arguments)]


# ---------------------------------------------------------------------------------------------
# Qwen3.5's XML calls

# a block between <tool_call> and </tool_call>: one function, its parameters, nothing else; a
# value is any text up to the first </parameter>
_PARAMETER = rf"\s*{PARAMETER_OPEN}([^>\n]+)>((?:(?!{PARAMETER_CLOSE}).)*){PARAMETER_CLOSE}"
_FUNCTION = re.compile(rf"\s*{FUNCTION_OPEN}([^>\n]+)>((?:{_PARAMETER})*)\s*{FUNCTION_CLOSE}\s*", re.DOTALL)
_PARAMETERS = re.compile(_PARAMETER, re.DOTALL)


class XmlCallParser:
    """Qwen3.5's format: text, in which each <tool_call>...</tool_call> block is read whole at its
    close (its arguments come in one piece) and becomes a call, its arguments a JSON object of
    the parameters' values (`parameter_value`, typed by the function's schema among `tools`).

    A block that does not parse (not exactly one <function=...>...</function> holding only
    <parameter=...>...</parameter> elements), or never closes and holds no whole function, is
    passed on as content, tags included. A call that repeats an earlier one (same name, same
    arguments) is dropped (the engine ends the answer right after it: engine/structured/repeats.py).
    Any chunking of the same text gives the same content and calls."""

    def __init__(self, tools: Sequence[dict] | None = None, id_factory: Callable[[], str] | None = None) -> None:
        self._new_id = id_factory or (lambda: "call_" + secrets.token_hex(12))
        functions = [tool.get("function", tool) for tool in tools or ()]
        self._schemas = {f["name"]: f.get("parameters") or {} for f in functions}
        self._buffer = ""  # text not yet turned into events (inside a block: what follows <tool_call>)
        self._in_block = False
        self.calls: list[dict] = []  # the finished calls in OpenAI's shape, in order

    @property
    def calls_started(self) -> int:
        """Calls begun so far, an open block included."""
        return len(self.calls) + self._in_block

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        """The events for whatever is still held back, at the end of the output."""
        events: list[Event] = []
        if self._in_block:  # cut off before </tool_call>: a whole function still counts
            self._end_block(self._buffer, "", events)
        elif self._buffer:
            events.append(Content(self._buffer))
        self._buffer, self._in_block = "", False
        return events

    def _step(self, events: list[Event]) -> bool:
        """Move as far as the buffer allows; True when the state changed and there may be more."""
        buffer = self._buffer
        if self._in_block:
            close = buffer.find(TOOL_CALL_CLOSE)
            if close < 0:
                return False
            self._buffer, self._in_block = buffer[close + len(TOOL_CALL_CLOSE):], False
            self._end_block(buffer[:close], TOOL_CALL_CLOSE, events)
            return True
        start = buffer.find(TOOL_CALL_OPEN)
        # hold back only a tail that could still grow into "<tool_call>"
        end = start if start >= 0 else len(buffer) - partial_tag(buffer, TOOL_CALL_OPEN)
        if end > 0:
            events.append(Content(buffer[:end]))
        if start < 0:
            self._buffer = buffer[end:]
            return False
        self._buffer, self._in_block = buffer[start + len(TOOL_CALL_OPEN):], True
        return True

    def _end_block(self, block: str, close: str, events: list[Event]) -> None:
        """The block between <tool_call> and `close` as a call, or as content."""
        call = parse_xml_call(block, self._schemas)
        if call is None:
            events.append(Content(TOOL_CALL_OPEN + block + close))
            return
        name, arguments = call
        if any(c["function"] == {"name": name, "arguments": arguments} for c in self.calls):
            return  # a repeat: dropped
        index, id_ = len(self.calls), self._new_id()
        self.calls.append({"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}})
        events += [CallStart(index, id_, name), Arguments(index, arguments)]


def parse_xml_call(block: str, schemas: dict[str, dict]) -> tuple[str, str] | None:
    """The (name, arguments as JSON text) of the call a block holds, or None when it holds none;
    `schemas`: each function's parameters schema by name (a function not there: values untyped)."""
    match = _FUNCTION.fullmatch(block)
    if match is None:
        return None
    name, body = match.group(1), match.group(2)
    properties = schemas.get(name, {}).get("properties") or {}
    arguments = {key: parameter_value(value, properties.get(key)) for key, value in _PARAMETERS.findall(body)}
    return name, json.dumps(arguments, ensure_ascii=False)


def parameter_value(text: str, schema: dict | None) -> Any:
    """A parameter's text as the JSON value its schema says, as vLLM's qwen3_coder parser reads
    it: the newline after the opening tag and the one before the closing are the layout's; a
    string is the text as it is; anything else is read as JSON, or kept as text when it does not
    parse (so is a value whose schema has no type, or that is not among the properties)."""
    text = text.removeprefix("\n").removesuffix("\n")
    types = value_types(schema)
    if "string" in types:
        return None if text == "null" and "null" in types else text
    if "boolean" in types and text.strip() in ("True", "False"):  # (Python's spelling, as Jinja's `string` writes it)
        return text.strip() == "True"
    try:
        return json.loads(text)
    except ValueError:
        return text


def value_types(schema: dict | None) -> set[str]:
    """The JSON types a property's schema names: its "type", and those of its anyOf/oneOf
    branches (Optional[str] in pydantic's schemas); empty when it names none."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    types = {t for t in (kind if isinstance(kind, list) else [kind]) if isinstance(t, str)}
    for branch in (*schema.get("anyOf", ()), *schema.get("oneOf", ())):
        types |= value_types(branch)
    return types


ToolParser = ToolCallParser | JsonAnswerParser | XmlCallParser  # feed(text), finish(), calls, calls_started
