"""One answer decoder for every protocol: a choice's generated text in, typed parts out.

    text ──> reasoning splitter ──> reasoning ───────────────────────> Reasoning
       (a thinking model's markers)  └─> content ──> tool-call parser ──> Text, ToolCallStart,
                                        (the template's call syntax)      ToolCallArguments
    end  ──> Finish (the engine's reason, the stop that matched, whether the answer called tools)

    token ids ──> harmony's parser (gpt-oss: harmony.py) ──> the same parts

The same parts whether the answer comes whole or streamed, however it is chunked (the splitter
and the parser hold back a marker's first characters until the next chunk tells). OpenAI's chat,
Anthropic's messages and OpenAI's responses only translate parts into their own wire events; a
new answer format (a template's tool syntax, a reasoning marker, harmony's channels) is added here
and reaches all three.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inferd.api.conversation.harmony import HARMONY_ENDS, HarmonyDecoder, speaks_harmony
from inferd.api.conversation.parts import Finish, Part, Reasoning, Text, ToolCallArguments, ToolCallStart
from inferd.api.conversation.reasoning import PromptReasoning, ReasoningSplitter, prompt_reasoning
from inferd.api.conversation.tool_formats import ToolParser, tool_parser
from inferd.api.conversation.tools import Arguments, CallStart, Content
from inferd.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class AnswerFormat:
    """How the answers to one prompt are written: a thinking model's reasoning (None: it does not
    reason), and whether tools were offered (their syntax follows the model's chat template); or
    harmony's channels (gpt-oss: harmony.py), read from the answer's token ids."""

    reasoning: PromptReasoning | None = None
    tools: bool = False
    call_id: Callable[[], str] | None = None  # a protocol's own tool-call ids (Anthropic's toolu_...)
    harmony: bool = False  # the model speaks harmony: the decoder reads token ids, not text
    # the offered functions (OpenAI function dicts): they type an XML call's values (tool_formats.py)
    functions: tuple[dict, ...] = ()

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end such an answer besides the model's EOS (harmony's <|call|>, <|return|>)."""
        return HARMONY_ENDS if self.harmony else ()

    def decoder(self, tokenizer: Tokenizer) -> Decoder:
        if self.harmony:
            return HarmonyDecoder(tokenizer, self.tools, self.call_id)
        return AnswerDecoder(tokenizer, self)


def answer_format(tokenizer: Tokenizer, prompt: Sequence[int], tools: bool,
                  call_id: Callable[[], str] | None = None, functions: Sequence[dict] = ()) -> AnswerFormat:
    """How the model of `tokenizer` writes its answer to `prompt`: harmony's channels, or its
    chat template's reasoning markers and tool-call syntax (`functions`: the offered ones)."""
    if speaks_harmony(tokenizer):
        return AnswerFormat(None, tools, call_id, harmony=True)
    return AnswerFormat(prompt_reasoning(tokenizer, prompt), tools, call_id, functions=tuple(functions))


class AnswerDecoder:
    """One choice's text, fed as it comes; `feed` returns the parts each piece completes (its
    token ids are harmony's business: HarmonyDecoder takes the same call)."""

    def __init__(self, tokenizer: Tokenizer, answer: AnswerFormat) -> None:
        self.splitter: ReasoningSplitter | None = answer.reasoning.splitter() if answer.reasoning else None
        self.parser: ToolParser | None = (tool_parser(tokenizer, answer.call_id, answer.functions)
                                          if answer.tools else None)

    @property
    def called(self) -> bool:
        """A tool call has begun."""
        return self.parser is not None and self.parser.calls_started > 0

    @property
    def calls(self) -> list[dict]:
        """The finished calls in OpenAI's shape ({"id", "type", "function": {"name", "arguments"}})."""
        return self.parser.calls if self.parser is not None else []

    def feed(self, text: str, finished: bool = False, reason: str | None = None,
             stop: str | int | None = None, token_ids: Sequence[int] = ()) -> list[Part]:
        """The parts `text` completes; with `finished`, the rest held back, then Finish."""
        parts: list[Part] = []
        content = text
        if self.splitter is not None:  # (a piece's reasoning comes before its content)
            pieces = self.splitter.feed(text) + (self.splitter.finish() if finished else [])
            reasoning = "".join(p.text for p in pieces if p.channel == "reasoning")
            content = "".join(p.text for p in pieces if p.channel == "content")
            if reasoning:
                parts.append(Reasoning(reasoning))
        if self.parser is None:
            if content:
                parts.append(Text(content))
        else:
            found = self.parser.feed(content) + (self.parser.finish() if finished else [])
            called = self.called  # (after the whole piece: a newline before its first call is filler too)
            for event in found:
                if isinstance(event, Content) and event.text:
                    parts.append(Text(event.text, filler=called and not event.text.strip()))
                elif isinstance(event, CallStart):
                    parts.append(ToolCallStart(event.index, event.id, event.name))
                elif isinstance(event, Arguments):
                    parts.append(ToolCallArguments(event.index, event.fragment))
        if finished:
            parts.append(Finish(reason, stop, self.called))
        return parts


Decoder = AnswerDecoder | HarmonyDecoder  # feed(text, finished, reason, stop, token_ids), called, calls


@dataclass(frozen=True)
class WholeAnswer:
    """A whole answer's parts gathered: what a non-streamed reply is made of."""

    reasoning: str
    text: str  # the content, filler included (a front-end drops blank content beside calls)
    calls: list[dict]  # the finished calls in OpenAI's shape
    finish: Finish


def decode_whole(tokenizer: Tokenizer, answer: AnswerFormat, text: str, reason: str | None,
                 stop: str | int | None = None, token_ids: Sequence[int] = ()) -> WholeAnswer:
    """A whole answer (its text, and its token ids for harmony): the decoder fed once."""
    decoder = answer.decoder(tokenizer)
    parts = decoder.feed(text, True, reason, stop, token_ids)
    finish = parts[-1]
    assert isinstance(finish, Finish)
    return WholeAnswer(_joined(parts, Reasoning), _joined(parts, Text), decoder.calls, finish)


def _joined(parts: Sequence[Part], kind: type[Text] | type[Reasoning]) -> str:
    return "".join(p.text for p in parts if isinstance(p, kind))
