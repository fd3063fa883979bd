"""The typed parts of an answer, whatever wrote it: what every decoder gives (answer.py for text
formats, harmony.py for gpt-oss's channels) and every protocol translates into its wire events."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Text:
    text: str
    filler: bool = False  # blank text once a tool call began (the newline between calls): no content


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int  # the call's, from 0 in the answer
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArguments:
    index: int
    fragment: str  # the next piece of the call's arguments (JSON text)


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str | None  # the engine's finish reason ("stop", "length", ...)
    stop: str | int | None  # the stop string or token that ended it
    called: bool  # the answer called tools


Part = Text | Reasoning | ToolCallStart | ToolCallArguments | Finish
