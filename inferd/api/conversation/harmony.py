"""gpt-oss's chat format, harmony, through OpenAI's own library (openai_harmony): the prompt
rendered from the conversation, the answer parsed from its token ids into the typed parts.

    <|start|>assistant<|channel|>analysis<|message|>the reasoning<|end|>           -> Reasoning
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json
        <|message|>{"arguments": ...}<|call|>                   -> ToolCallStart, ToolCallArguments
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>              -> Text

A model speaks harmony when its vocabulary holds harmony's special tokens at harmony's ids (a
gpt-oss checkpoint's tokenizer is o200k_harmony, so its ids are harmony's own). The system
message carries the reasoning effort (low, medium, high); the client's system and developer
messages become the developer message's instructions, with the tools as harmony's `functions`
namespace; earlier reasoning, calls and results become analysis, commentary and tool messages.

The answer is read from token ids, never from the text (the detokenizer drops special tokens, and
they are the structure): `HarmonyDecoder.feed` takes each output's new ids, so any chunking of the
same tokens gives the same parts. `<|call|>` and `<|return|>` end the answer (HARMONY_ENDS, the
engine's stop tokens for such a prompt). An answer that is not harmony after all (no header within
HEADER_LIMIT tokens, or tokens harmony refuses) is passed on as text from there.
"""

from __future__ import annotations

import codecs
import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyError,
    Message,
    ReasoningEffort,
    Role,
    StreamableParser,
    SystemContent,
    ToolDescription,
)

from inferd.api.conversation.parts import Finish, Part, Reasoning, Text, ToolCallArguments, ToolCallStart
from inferd.text.o200k import harmony_encoding
from inferd.text.tokenizer import Tokenizer

# harmony's special tokens at their ids in o200k_harmony (openai_harmony's encoding)
SPECIALS = {"<|return|>": 200002, "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006,
            "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012}
MESSAGE, END, CALL, RETURN = SPECIALS["<|message|>"], SPECIALS["<|end|>"], SPECIALS["<|call|>"], SPECIALS["<|return|>"]
HARMONY_ENDS = (RETURN, CALL)  # the answer ends: a final message, or a call for the client to run
HEADER_LIMIT = 64  # tokens: a header (role, channel, recipient, content type) longer than this is not one
FUNCTIONS = "functions."  # the namespace harmony puts the offered tools in

# the protocols' effort words as harmony's; None: harmony's default (medium)
EFFORTS = {"none": ReasoningEffort.LOW, "minimal": ReasoningEffort.LOW, "low": ReasoningEffort.LOW,
           "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH, "xhigh": ReasoningEffort.HIGH}


def speaks_harmony(tokenizer: Tokenizer) -> bool:
    """Whether the model's vocabulary holds harmony's special tokens at harmony's ids."""
    return tokenizer.vocab_size > max(SPECIALS.values()) and all(
        tokenizer.id_to_token(i) == name for name, i in SPECIALS.items())


# ---------------------------------------------------------------------------------------------
# the prompt


def conversation(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]],
                 effort: str | None = None) -> Conversation:
    """The messages (template dicts: role, content, tool_calls, tool_call_id, reasoning_content)
    and the tools (OpenAI function dicts) as a harmony conversation (the module's docstring)."""
    system = SystemContent.new().with_reasoning_effort(EFFORTS.get(effort or "medium", ReasoningEffort.MEDIUM))
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = [_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
    if any(instructions) or tools:
        developer = DeveloperContent.new()
        if any(instructions):
            developer = developer.with_instructions("\n\n".join(i for i in instructions if i))
        if tools:
            developer = developer.with_function_tools([_tool(t["function"]) for t in tools])
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    names: dict[str, str] = {}  # a call's id -> its function, for the tool message that answers it
    for message in messages:
        out += _messages(message, names)
    return Conversation.from_messages(out)


def render(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], effort: str | None = None,
           add_generation_prompt: bool = True) -> list[int]:
    """The prompt's token ids: the conversation, then the assistant's turn opened (HarmonyError
    for messages harmony cannot render)."""
    encoding, chat = harmony_encoding(), conversation(messages, tools, effort)
    if add_generation_prompt:
        return encoding.render_conversation_for_completion(chat, Role.ASSISTANT)
    return encoding.render_conversation(chat)


def _messages(message: dict[str, Any], names: dict[str, str]) -> list[Message]:
    role, text = message.get("role"), _text(message.get("content"))
    if role == "user":
        return [Message.from_role_and_content(Role.USER, text)]
    if role == "tool":
        name = names.get(message.get("tool_call_id") or "") or message.get("name") or next(reversed(names.values()), "")
        return [Message.from_author_and_content(Author.new(Role.TOOL, FUNCTIONS + name), text)
                .with_channel("commentary").with_recipient("assistant")]
    if role != "assistant":
        return []  # (system and developer: the developer message's instructions)
    out = []
    if message.get("reasoning_content"):
        out.append(Message.from_role_and_content(Role.ASSISTANT, _text(message["reasoning_content"]))
                   .with_channel("analysis"))
    calls = message.get("tool_calls") or []
    if text or not calls:  # (beside calls, the text is their preamble)
        out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("commentary" if calls else "final"))
    for call in calls:
        function = call["function"]
        names[call.get("id") or ""] = function["name"]
        arguments = function.get("arguments")
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        out.append(Message.from_role_and_content(Role.ASSISTANT, arguments).with_channel("commentary")
                   .with_recipient(FUNCTIONS + function["name"]).with_content_type("<|constrain|>json"))
    return out


def _tool(function: dict[str, Any]) -> ToolDescription:
    return ToolDescription.new(function["name"], function.get("description") or "", function.get("parameters"))


def _text(content: Any) -> str:
    """Message content as text: a string, None, or a list of {"type": "text", "text"} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


# ---------------------------------------------------------------------------------------------
# the answer


class HarmonyDecoder:
    """One choice's harmony answer, fed its token ids as they come; `feed` returns the parts each
    piece completes (AnswerDecoder's contract: answer.py). A message's kind is known once its
    header ends (`<|message|>`): analysis is reasoning, a message to a recipient is a call (with
    `tools`; else it is dropped), any other is text; its content then streams as it comes."""

    def __init__(self, tokenizer: Tokenizer, tools: bool, call_id: Callable[[], str] | None = None) -> None:
        self._tokenizer = tokenizer
        self._tools = tools
        self._new_id = call_id or (lambda: "call_" + secrets.token_hex(12))
        self._parser = StreamableParser(harmony_encoding(), Role.ASSISTANT)
        self._header: list[int] = []  # the header read so far (its text, if it never ends)
        self._kind: str | None = None  # the message whose content is read: reasoning, text, call, drop
        self._call: dict[str, Any] | None = None  # the call being read, in OpenAI's shape
        self._calls: list[dict[str, Any]] = []
        self._plain: codecs.IncrementalDecoder | None = None  # not harmony after all: the tokens' text

    @property
    def called(self) -> bool:
        """A tool call has begun."""
        return bool(self._calls) or self._call is not None

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The finished calls in OpenAI's shape ({"id", "type", "function": {"name", "arguments"}})."""
        return list(self._calls)

    def feed(self, text: str, finished: bool = False, reason: str | None = None, stop: str | int | None = None,
             token_ids: Sequence[int] = ()) -> list[Part]:
        """The parts `token_ids` complete (the text is not read); with `finished`, the rest, then Finish."""
        parts: list[Part] = []
        for token in token_ids:
            if self._plain is not None:
                self._say_plain([token], parts)
            else:
                self._step(token, parts)
        if finished:
            self._end(parts)
            parts.append(Finish(reason, stop, self.called))
        return _merged(parts)

    def _step(self, token: int, parts: list[Part]) -> None:
        """One token through the parser, and what it says."""
        try:
            self._parser.process(token)
        except HarmonyError:
            if self._kind is None and not self._header:  # between messages: one without <|start|>assistant
                self._parser = StreamableParser(harmony_encoding(), Role.ASSISTANT)
                return self._retry(token, parts)
            return self._give_up([*self._header, token], parts)
        if self._kind is None:
            self._header.append(token)
            if token == MESSAGE:
                self._begin(parts)
            elif len(self._header) > HEADER_LIMIT:
                self._give_up(self._header, parts)
            return None
        if token in (END, CALL, RETURN):
            return self._finish_message()
        delta = self._parser.last_content_delta
        if delta:
            self._say(delta, parts)
        return None

    def _retry(self, token: int, parts: list[Part]) -> None:
        try:
            self._parser.process(token)
        except HarmonyError:
            return self._give_up([token], parts)
        self._header.append(token)
        return None

    def _begin(self, parts: list[Part]) -> None:
        """A header has ended: the kind of the message whose content follows."""
        recipient, channel = self._parser.current_recipient, self._parser.current_channel
        self._header = []
        if recipient and recipient not in ("assistant", "user"):
            self._kind = "call" if self._tools else "drop"
            if self._tools:
                name = recipient.removeprefix(FUNCTIONS)
                self._call = {"id": self._new_id(), "type": "function", "function": {"name": name, "arguments": ""}}
                parts.append(ToolCallStart(len(self._calls), self._call["id"], name))
        else:
            self._kind = "reasoning" if channel == "analysis" else "text"

    def _say(self, delta: str, parts: list[Part]) -> None:
        if self._kind == "reasoning":
            parts.append(Reasoning(delta))
        elif self._kind == "text":
            parts.append(Text(delta))
        elif self._kind == "call" and self._call is not None:
            self._call["function"]["arguments"] += delta
            parts.append(ToolCallArguments(len(self._calls), delta))

    def _finish_message(self) -> None:
        if self._call is not None:
            self._calls.append(self._call)
        self._call, self._kind = None, None

    def _end(self, parts: list[Part]) -> None:
        """The answer has ended: a message cut short keeps what it said; a header cut short is
        dropped, unless it holds no special token at all (then it was text, not a header)."""
        if self._plain is not None:
            text = self._plain.decode(b"", final=True)
            if text:
                parts.append(Text(text))
            return
        if self._kind is not None:
            self._finish_message()
        elif self._header and not any(t in self._tokenizer.special_ids for t in self._header):
            self._give_up(self._header, parts)
            self._end(parts)

    def _give_up(self, tokens: list[int], parts: list[Part]) -> None:
        """Not harmony (any more): `tokens` and every one after them are text."""
        self._finish_message()
        self._header = []
        self._plain = codecs.getincrementaldecoder("utf-8")("replace")
        self._say_plain(tokens, parts)

    def _say_plain(self, tokens: list[int], parts: list[Part]) -> None:
        assert self._plain is not None
        special = self._tokenizer.special_ids
        data = b"".join(self._tokenizer.token_bytes(t) for t in tokens if t not in special)
        text = self._plain.decode(data)
        if text:
            parts.append(Text(text))


def _merged(parts: list[Part]) -> list[Part]:
    """Neighbouring pieces of one kind (and one call) as one part: fewer events, the same text."""
    out: list[Part] = []
    for part in parts:
        last = out[-1] if out else None
        if isinstance(part, (Text, Reasoning)) and type(last) is type(part):
            out[-1] = type(part)(last.text + part.text)  # type: ignore[union-attr]
        elif isinstance(part, ToolCallArguments) and isinstance(last, ToolCallArguments) and last.index == part.index:
            out[-1] = ToolCallArguments(part.index, last.fragment + part.fragment)
        else:
            out.append(part)
    return out
