"""Reasoning as its own channel: a thinking model's answer split into its reasoning and its content.

    <think>\\nthe model reasons here...\\n</think>\\n\\nthe answer      (Qwen3, DeepSeek-R1 style)
           └──────── reasoning ────────┘          └ content ┘

A model thinks when its chat template writes the markers (`reasoning_markers`). The generated
text may start inside the reasoning (a template whose generation prompt opens `<think>` itself:
`starts_inside`) or before it (Qwen3 writes `<think>` as its first tokens). Only the first
reasoning block counts: text after `</think>` is content, markers and all. The splitter works on
the streamed text as it comes, so the same answer splits the same way whatever its chunking: a
chunk ending in a marker's first characters holds them back until the next chunk tells.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from inferd.text.tokenizer import Tokenizer

Channel = Literal["reasoning", "content"]


@dataclass(frozen=True)
class Markers:
    open: str
    close: str


THINK = Markers("<think>", "</think>")


def reasoning_markers(tokenizer: Tokenizer) -> Markers | None:
    """The markers the model's chat template thinks between, or None for a model that does not."""
    template = tokenizer.chat_template or ""
    return THINK if THINK.open in template and THINK.close in template else None


def starts_inside(prompt_text: str, markers: Markers) -> bool:
    """Whether the prompt leaves a reasoning block open (its generation prompt wrote the opening)."""
    return prompt_text.rfind(markers.open) > prompt_text.rfind(markers.close)


@dataclass(frozen=True)
class Piece:
    channel: Channel
    text: str


class ReasoningSplitter:
    """Text in, pieces of reasoning and content out, in order (the module's docstring)."""

    def __init__(self, markers: Markers, inside: bool = False) -> None:
        self.markers = markers
        self.state: Literal["before", "inside", "after"] = "inside" if inside else "before"
        self.held = ""  # text that may be the start of the marker looked for
        self.trim = inside  # just past a marker: its newlines are dropped
        self.reasoning = ""  # everything said in the reasoning channel so far

    def feed(self, text: str) -> list[Piece]:
        pieces: list[Piece] = []
        text, self.held = self.held + text, ""
        while text:
            if self.trim:  # the newlines a template writes after a marker belong to neither channel
                text = text.lstrip("\n")
                self.trim = not text
                continue
            if self.state == "after":
                pieces.append(Piece("content", text))
                break
            opening = self.state == "before"
            marker = self.markers.open if opening else self.markers.close
            if opening and not marker.startswith(text[: len(marker)].lstrip()):
                self.state = "after"  # the answer does not open with reasoning: all of it is content
                continue
            channel: Channel = "content" if opening else "reasoning"
            at = text.find(marker)
            if at < 0:
                keep = _partial_suffix(text, marker)
                pieces.append(Piece(channel, text[: len(text) - keep]))
                self.held = text[len(text) - keep:]
                break
            pieces.append(Piece(channel, text[:at]))
            text, self.state, self.trim = text[at + len(marker):], "inside" if opening else "after", True
        return self._kept(pieces)

    def finish(self) -> list[Piece]:
        """The text held back, once the answer has ended (it was no marker after all)."""
        held, self.held = self.held, ""
        channel: Channel = "reasoning" if self.state == "inside" else "content"
        return self._kept([Piece(channel, held)])

    def _kept(self, pieces: list[Piece]) -> list[Piece]:
        kept = [p for p in pieces if p.text]
        self.reasoning += "".join(p.text for p in kept if p.channel == "reasoning")
        return kept


@dataclass(frozen=True)
class PromptReasoning:
    """How the answer to one prompt of a thinking model reasons: the markers, and whether the
    prompt opened the block itself. Made once, by `prompt_reasoning`, when the prompt is."""

    markers: Markers
    inside: bool

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.markers, self.inside)


def prompt_reasoning(tokenizer: Tokenizer, prompt: Sequence[int]) -> PromptReasoning | None:
    """None for a model that does not think; else its markers, and whether `prompt` (its last
    tokens are enough) leaves the reasoning block open."""
    markers = reasoning_markers(tokenizer)
    if markers is None:
        return None
    return PromptReasoning(markers, starts_inside(tokenizer.decode(prompt[-32:], skip_special_tokens=False), markers))


def split_whole(text: str, markers: Markers, inside: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole answer: the splitter over one chunk."""
    splitter = ReasoningSplitter(markers, inside)
    pieces = splitter.feed(text) + splitter.finish()
    return (splitter.reasoning, "".join(p.text for p in pieces if p.channel == "content"))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
