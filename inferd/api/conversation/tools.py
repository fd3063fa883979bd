"""Tool calling for models whose chat template knows nothing about tools (OpenAI tool dicts in).

We use a Hermes-style text format, taught to the model by a system prompt:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

    tools_system_prompt   the instruction text listing the functions
    history_message       earlier assistant tool calls / tool results rewritten as plain text
    ToolCallParser        model output text -> Content / CallStart / Arguments events, streaming

The grammars that hold calls to this format are in tool_grammar.py.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# An answer holds at most this many calls: a small model, offered "one more", tends to go on
# calling until max_tokens.
MAX_PARALLEL_CALLS = 4

# The exact call header the prompt shows and the grammar forces; the arguments object after it
# streams. (Arguments given as a JSON string are buffered and parsed whole instead.)
_HEADER = re.compile(r'\s*\{"name": ("(?:[^"\\]|\\.)*"), "arguments": (?=\{)')
# What may sit between the arguments and the close tag: the wrapper's own "}" and whitespace.
_WRAPPER_END = re.compile(r"\s*(?:\}\s*)?$")


def tools_system_prompt(tools: list[dict]) -> str:
    """The instruction text that lists `tools` (OpenAI tool dicts) and explains the call format."""
    lines = [json.dumps(_function_spec(tool), ensure_ascii=False) for tool in tools]
    return (
        "You can call functions to help answer the user. The functions are listed below, "
        "one JSON object per line, inside <tools></tools>:\n"
        "<tools>\n" + "\n".join(lines) + "\n</tools>\n"
        "To call a function, write one <tool_call></tool_call> block per call, each holding a JSON "
        "object with the function's name and its arguments, where the arguments are a JSON object "
        "that matches the function's parameters schema:\n"
        '<tool_call>{"name": "<function-name>", "arguments": {"<argument-name>": <value>}}</tool_call>\n'
        "If no function call is needed, answer normally."
    )


def _function_spec(tool: dict) -> dict:
    function = tool["function"]
    return {key: function[key] for key in ("name", "description", "parameters") if key in function}


def history_message(message: dict) -> dict:
    """An OpenAI chat message rewritten for a template without tool support."""
    role, content = message.get("role"), message.get("content")
    if role == "assistant" and message.get("tool_calls"):
        calls = [_call_text(call["function"]) for call in message["tool_calls"]]
        return {"role": "assistant", "content": _text(content) + "\n".join(calls)}
    if role == "tool":
        return {"role": "tool", "content": "<tool_response>\n" + _text(content) + "\n</tool_response>"}
    return {key: message[key] for key in ("role", "content", "name") if key in message}


def _call_text(function: dict) -> str:
    arguments = function.get("arguments") or "{}"
    try:
        arguments = json.loads(arguments)
    except (TypeError, ValueError):
        pass  # not JSON: the model sees the string as the client sent it
    call = {"name": function["name"], "arguments": arguments}
    return TOOL_CALL_OPEN + json.dumps(call, ensure_ascii=False) + TOOL_CALL_CLOSE


def _text(content: str | list | None) -> str:
    """Message content as text: a string, None, or a list of {"type": "text", "text"} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


# ---------------------------------------------------------------------------------------------
# parsing the model's output


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    fragment: str


Event = Content | CallStart | Arguments


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""


class ToolCallParser:
    """Splits model output into content and tool calls, as the text arrives.

    Three states: outside a block (text is content); inside a block, undecided (buffering after
    `<tool_call>`); inside a block, streaming the arguments after the exact header. Any chunking
    of the same text gives the same content and calls.

    A block in the exact format streams its arguments at once; any other block is buffered to its
    `</tool_call>` and parsed whole; one that does not parse, or never closes, is passed on as
    content, tags included. A call that repeats an earlier one (same name, same arguments text)
    is dropped: while a streaming call could still turn out a repeat (same name, its arguments so
    far a prefix of the earlier call's), its events are held back (the engine ends the answer
    right after such a repeat: engine/structured/repeats.py).

    NOTE: a streamed call's arguments are valid JSON whenever the model wrote valid JSON (always,
    under the grammars of tool_grammar.py); a free-running model that opens the exact header and
    then writes broken JSON, or is cut off, keeps what it wrote, since the fragments have already
    gone out (OpenAI's own API has the same caveat).
    """

    def __init__(self, id_factory: Callable[[], str] | None = None) -> None:
        self._new_id = id_factory or (lambda: "call_" + secrets.token_hex(12))
        self._calls: list[_Call] = []
        self._buffer = ""  # text not yet turned into events
        self._in_block = False
        self._streaming: _Call | None = None  # the call whose arguments are streaming
        self._sent = 0  # how much of _buffer went out as Arguments (while streaming)
        self._held: list[Event] | None = None  # the streaming call's events, while it may be a repeat

    @property
    def calls(self) -> list[dict]:
        """The finished calls in OpenAI's shape, in order."""
        return [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self._calls
        ]

    @property
    def calls_started(self) -> int:
        """Calls begun so far, the one whose arguments are streaming included."""
        return len(self._calls) + (self._streaming is not None)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        """The events for whatever is still held back, at the end of the output."""
        events: list[Event] = []
        if self._streaming is not None:  # cut off inside the arguments
            cut = len(self._buffer) - partial_tag(self._buffer, TOOL_CALL_CLOSE)
            self._end_streamed_call(self._buffer[:cut], events)
        elif self._in_block:
            events.append(Content(TOOL_CALL_OPEN + self._buffer))
        elif self._buffer:
            events.append(Content(self._buffer))
        self._buffer, self._in_block = "", False
        return events

    def _step(self, events: list[Event]) -> bool:
        """Move as far as the buffer allows; True when the state changed and there may be more."""
        if self._streaming is not None:
            return self._step_arguments(events)
        if self._in_block:
            return self._step_block(events)
        return self._step_text(events)

    def _step_text(self, events: list[Event]) -> bool:
        start = self._buffer.find(TOOL_CALL_OPEN)
        # hold back only a tail that could still grow into "<tool_call>"
        end = start if start >= 0 else len(self._buffer) - partial_tag(self._buffer, TOOL_CALL_OPEN)
        if end > 0:
            events.append(Content(self._buffer[:end]))
        if start < 0:
            self._buffer = self._buffer[end:]
            return False
        self._buffer = self._buffer[start + len(TOOL_CALL_OPEN) :]
        self._in_block = True
        return True

    def _step_block(self, events: list[Event]) -> bool:
        close = self._buffer.find(TOOL_CALL_CLOSE)
        header = _HEADER.match(self._buffer)
        name = json.loads(header.group(1)) if header and _is_json(header.group(1)) else None
        if header and name is not None and (close < 0 or header.end() <= close):
            self._streaming = _Call(self._new_id(), name)
            self._held = [] if self._may_repeat(self._streaming, "") else None
            self._emit(events, CallStart(len(self._calls), self._streaming.id, name))
            self._buffer, self._sent = self._buffer[header.end() :], 0
            return True
        if close < 0:
            return False  # not the exact format (yet): wait for the close tag
        block = self._buffer[:close]
        self._buffer, self._in_block = self._buffer[close + len(TOOL_CALL_CLOSE) :], False
        call = parse_call(block)
        if call is None:
            events.append(Content(TOOL_CALL_OPEN + block + TOOL_CALL_CLOSE))
            return True
        if self._repeats(call, call.arguments):
            return True
        call.id = self._new_id()
        events.append(CallStart(len(self._calls), call.id, call.name))
        events.append(Arguments(len(self._calls), call.arguments))
        self._calls.append(call)
        return True

    def _step_arguments(self, events: list[Event]) -> bool:
        close = self._buffer.find(TOOL_CALL_CLOSE)
        if close >= 0:
            self._end_streamed_call(self._buffer[:close], events)
            self._buffer = self._buffer[close + len(TOOL_CALL_CLOSE) :]
            return True
        # hold back what could be the wrapper's "}" (plus whitespace) and the start of the close tag
        partial = max(len(self._buffer) - partial_tag(self._buffer, TOOL_CALL_CLOSE), self._sent)
        end = _WRAPPER_END.search(self._buffer, self._sent, partial).start()
        if end > self._sent:
            self._emit(events, Arguments(len(self._calls), self._buffer[self._sent : end]))
            self._sent = end
        if self._held is not None and not self._may_repeat(self._streaming, self._buffer[: self._sent]):
            events += self._held  # it differs from every earlier call: out it goes
            self._held = None
        return False

    def _end_streamed_call(self, text: str, events: list[Event]) -> None:
        """Finish the streaming call whose arguments (and wrapper end) are `text`."""
        body = text.rstrip()
        candidates = [body[:-1].rstrip()] if body.endswith("}") else []
        arguments = next((c for c in candidates + [body] if _is_json(c)), text)
        call, self._streaming = self._streaming, None
        assert call is not None
        if len(arguments) > self._sent:
            self._emit(events, Arguments(len(self._calls), arguments[self._sent :]))
        held, self._held = self._held, None
        self._in_block, self._sent = False, 0
        if held is not None and self._repeats(call, arguments):
            return  # a repeat: dropped, nothing of it went out
        events += held or []
        call.arguments = arguments
        self._calls.append(call)

    def _emit(self, events: list[Event], event: Event) -> None:
        (self._held if self._held is not None else events).append(event)

    def _may_repeat(self, call: _Call | None, arguments_so_far: str) -> bool:
        """Whether `call`, with these arguments so far, could still end as an earlier call."""
        return call is not None and any(c.name == call.name and c.arguments.startswith(arguments_so_far)
                                        for c in self._calls)

    def _repeats(self, call: _Call, arguments: str) -> bool:
        return any(c.name == call.name and c.arguments == arguments for c in self._calls)


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def parse_call(block: str) -> _Call | None:
    """The call a free-form block holds (id left empty), or None when it is not a call."""
    try:
        data = json.loads(block)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        if not _is_json(arguments):
            return None
    else:
        arguments = json.dumps(arguments, ensure_ascii=False)
    return _Call("", data["name"], arguments)
