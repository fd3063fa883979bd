"""Segmented streaming (`"segment": "sentence"` or `"line"`): each choice's text released in
whole sentences or whole lines, as an output hook after the filter.

    "sentence": held text --pysbd--> sentences; all go but the last, which is still open (unless
                it ends with a newline); the rest waits for more text
    "line":     everything up to and including the last newline goes
    final:      whatever is held goes

pysbd (rules for abbreviations, decimals, initials, ...) costs 0.1-0.5 ms a call, so it runs only
when the text could have just crossed a boundary: a delimiter (. ! ? 。 ！ ？, a newline),
maybe closing quotes and spaces, then the start of something else. A boundary pysbd reports
counts only after a delimiter (so every delta ends with one, quotes and spaces aside).
"""

from __future__ import annotations

import functools
import re

import pysbd

DELIMITERS = ".!?。！？\n"
# a delimiter, closing quotes or brackets, spaces, then something that starts a new sentence
_CANDIDATE = re.compile(r"[.!?。！？\n][\"'”’)\]]*\s*[^\s.!?。！？\"'”’)\]]|\n")
_ENDS_SENTENCE = re.compile(r"[.!?。！？\n][\"'”’)\]]*\s*\Z")
_TRAILERS = " \t\r\f\v\"'”’)]"  # what may follow a delimiter before the next sentence starts


@functools.cache
def _pysbd() -> pysbd.Segmenter:
    """One segmenter, built on first use and reused (the engine thread is its only caller)."""
    return pysbd.Segmenter(language="en", clean=False)


def sentence_end(text: str) -> int:
    """Where the last whole sentence of `text` ends (0: none yet): where the last segment pysbd
    finds starts (that one is still open), or the end if it ends with a newline."""
    boundaries, position = [], 0
    for segment in _pysbd().segment(text):
        found = text.find(segment, position)  # (pysbd may drop spaces around a segment)
        if found < 0:
            break
        boundaries.append(found)
        position = found + len(segment)
    if text.endswith("\n") and not text[position:].strip():
        boundaries.append(len(text))
    for end in reversed(boundaries):
        if end and _ENDS_SENTENCE.search(text[:end]):
            return end
    return 0


def _scan_start(held: str, scanned: int) -> int:
    """Where a candidate may start: the delimiter the searched text ends with (trailers aside),
    else the new text (candidates in the searched text were seen, and pysbd called on them)."""
    tail = held[:scanned].rstrip(_TRAILERS)
    return len(tail) - 1 if tail and tail[-1] in DELIMITERS else scanned


class SentenceHook:
    """Holds a choice's text back until it ends a sentence."""

    __slots__ = ("held", "scanned")

    def __init__(self) -> None:
        self.held = ""
        self.scanned = 0  # how far `held` has been searched for a boundary candidate

    def __call__(self, text: str, final: bool) -> tuple[str, bool]:
        held = self.held + text
        if final:
            self.held, self.scanned = "", 0
            return held, False
        if not _CANDIDATE.search(held, _scan_start(held, self.scanned)):
            self.held, self.scanned = held, len(held)
            return "", False
        end = sentence_end(held)
        self.held, self.scanned = held[end:], len(held) - end
        return held[:end], False


class LineHook:
    """Holds a choice's text back until it ends a line."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = ""

    def __call__(self, text: str, final: bool) -> tuple[str, bool]:
        held = self.held + text
        end = len(held) if final else held.rfind("\n") + 1
        self.held = held[end:]
        return held[:end], False


class WholeHook:
    """Holds a choice's whole text back until it ends: a stream answered in one piece (the
    server's functional degradation, api/routing/degradation.py: no per-token writes while overloaded)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: list[str] = []

    def __call__(self, text: str, final: bool) -> tuple[str, bool]:
        self.held.append(text)
        if not final:
            return "", False
        whole, self.held = "".join(self.held), []
        return whole, False


def segment_hook(segment: str) -> SentenceHook | LineHook | WholeHook | None:
    """The hook of a segment mode ("token": none)."""
    if segment == "sentence":
        return SentenceHook()
    if segment == "line":
        return LineHook()
    if segment == "whole":
        return WholeHook()
    return None
