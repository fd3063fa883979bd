"""Which tool-call format a model speaks, read from its chat template, and the parser for it.

    "hermes"       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, anywhere in the text:
                   what we teach a template without tools (tools.py), and what Hermes and Qwen
                   templates show
    "llama3_json"  the whole answer is one call, {"name": ..., "parameters": {...}}: Llama 3.1-3.3
                   templates ("Respond in the format {"name": function name, "parameters": ...")
    None           a template with a format of its own not known here (Mistral's [TOOL_CALLS] is a
                   control token the detokenizer drops): "auto" runs free, forced calls use Hermes

tool_grammar.py builds each format's grammars; the front-ends parse answers with `tool_parser`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from inferd.api.conversation.render import takes_tools
from inferd.api.conversation.tools import (
    TOOL_CALL_OPEN,
    Arguments,
    CallStart,
    Content,
    Event,
    ToolCallParser,
    parse_call,
)
from inferd.text.tokenizer import Tokenizer

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
LLAMA3_MARKER = '{"name": function name, "parameters": '  # the instruction Llama 3.1-3.3 templates carry


def tool_format(tokenizer: Tokenizer) -> str | None:
    """The tool-call format of the model's chat template (the module's docstring lists them)."""
    template = tokenizer.chat_template or ""
    if not takes_tools(tokenizer) or TOOL_CALL_OPEN in template:
        return HERMES
    if LLAMA3_MARKER in template:
        return LLAMA3_JSON
    return None


def tool_parser(tokenizer: Tokenizer, id_factory: Callable[[], str] | None = None) -> ToolParser:
    """A parser of the model's answers for its format (Hermes where it has none we know)."""
    if tool_format(tokenizer) == LLAMA3_JSON:
        return JsonAnswerParser(id_factory)
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


ToolParser = ToolCallParser | JsonAnswerParser  # feed(text), finish(), calls, calls_started
