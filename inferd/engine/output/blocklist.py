"""The streaming output filter: blocked terms never reach the client, even split across tokens.

    blocklist file --read_blocklist (start-up)--> Blocklist --OutputFilter (once per engine)-->
        an Aho-Corasick automaton over the plain terms + the compiled regexes
    per choice: FilterHook(text, final) -> (text to send now, stop)

Each choice's hook keeps the text it has not released yet (`held`). Every call matches
held + new text, case-insensitively: plain terms with the automaton (one pass for all of them),
regexes with `re`. It then releases everything but the longest suffix that could still grow into
a term: a suffix that is a prefix of some term (the automaton's trie answers `match`), and, with
regexes, the last `regex_hold` characters (the longest regex's maximum width less one; an
unbounded regex is held back REGEX_WINDOW characters, so a match longer than that may be
released in part). A term that ends in text not seen yet therefore starts inside `held`, and no
character of a blocked term is ever released unmasked.

    "mask": each matched character becomes "*" (the mask of held text is kept with it)
    "stop": the choice ends with finish_reason "content_filter", after the text before the term

Plain terms match anywhere, inside words too ("ass" in "class"); a regex like `re:\\bass\\b`
matches whole words (it sees REGEX_CONTEXT released characters before the window, for `\\b` and
lookbehinds). Case-insensitive means `str.lower` character by character.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import ahocorasick

from inferd.settings.values import SettingsError, read_lines

CONTENT_FILTER = "content_filter"  # the finish reason of a choice the filter stopped
REGEX_WINDOW = 64  # characters held back for a regex without a bounded width
REGEX_CONTEXT = 16  # released characters a regex sees before the window (\b, lookbehind)

Action = Literal["mask", "stop"]


@dataclass(frozen=True)
class Blocklist:
    terms: tuple[str, ...]  # plain terms
    patterns: tuple[str, ...]  # regular expressions (the file's `re:` lines)
    action: Action = "mask"


def read_blocklist(path: str, action: Action = "mask") -> Blocklist:
    """The blocklist file: one term per line, blank lines and lines starting with `#` skipped,
    `re:PATTERN` a regular expression. SettingsError names the file and the line."""
    where = "output_filter.blocklist_file"
    lines = read_lines(path, where)
    terms: list[str] = []
    patterns: list[str] = []
    for number, line in enumerate(lines, 1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        if not entry.startswith("re:"):
            terms.append(entry)
            continue
        try:
            empty = re.compile(entry[3:], re.IGNORECASE).fullmatch("") is not None
        except re.error as e:
            raise SettingsError(f"{where}: {path} line {number}: invalid regular expression ({e})") from None
        if empty:
            raise SettingsError(f"{where}: {path} line {number}: the regular expression matches the empty text")
        patterns.append(entry[3:])
    return Blocklist(tuple(terms), tuple(patterns), action)


def lower(text: str) -> str:
    """`text.lower()`, but never longer: a character whose lower case is two keeps its case."""
    low = text.lower()
    if len(low) == len(text):
        return low
    return "".join(c.lower() if len(c.lower()) == 1 else c for c in text)


def _max_width(pattern: re.Pattern[str]) -> int:
    """The longest text `pattern` can match, from re's own parser (a huge number: no bound)."""
    from re import _parser  # type: ignore[attr-defined]  # NOTE: private, the stdlib's only width oracle

    return int(_parser.parse(pattern.pattern, pattern.flags).getwidth()[1])


class OutputFilter:
    """The blocklist compiled once and shared by every choice; `hook()` gives a choice its state."""

    def __init__(self, blocklist: Blocklist) -> None:
        self.action = blocklist.action
        terms = {lower(t) for t in blocklist.terms if t}
        self.automaton: ahocorasick.Automaton | None = None
        self.max_term_len = max(map(len, terms), default=0)
        if terms:
            self.automaton = ahocorasick.Automaton(ahocorasick.STORE_INTS)
            for term in terms:
                self.automaton.add_word(term, len(term))
            self.automaton.make_automaton()
        self.patterns = [re.compile(p, re.IGNORECASE) for p in blocklist.patterns]
        widest = max((_max_width(p) for p in self.patterns), default=0)
        self.regex_hold = max(min(widest, REGEX_WINDOW) - 1, 0)

    def hook(self) -> FilterHook:
        return FilterHook(self)

    def spans(self, text: str, low: str, context: str) -> list[tuple[int, int]]:
        """Every match in `text` (`low` its lower case) as [start, end) character offsets."""
        found: list[tuple[int, int]] = []
        if self.automaton is not None:
            found += [(end + 1 - length, end + 1) for end, length in self.automaton.iter(low)]
        if self.patterns:
            window, skip = context + text, len(context)
            for pattern in self.patterns:
                found += [(m.start() - skip, m.end() - skip) for m in pattern.finditer(window, skip) if m.end() > m.start()]
        return found

    def releasable(self, low: str) -> int:
        """How much of the text may go: all but the longest suffix that could still start a match."""
        cut = len(low) - self.regex_hold if self.patterns else len(low)
        if self.automaton is not None:
            match = self.automaton.match  # True when its argument is a prefix of some term
            for start in range(max(0, len(low) - self.max_term_len + 1), cut):
                if match(low[start:]):
                    return start
        return max(cut, 0)


class FilterHook:
    """One choice's filter state: the text not released yet and which of its characters are masked."""

    __slots__ = ("filter", "held", "masked", "context")

    def __init__(self, output_filter: OutputFilter) -> None:
        self.filter = output_filter
        self.held = ""
        self.masked = bytearray()  # [len(held)], 1 = a character of a matched term
        self.context = ""  # the last REGEX_CONTEXT characters released

    def __call__(self, text: str, final: bool) -> tuple[str, bool | str]:
        text = self.held + text
        if not text:
            return "", False
        f = self.filter
        low = lower(text)
        masked = self.masked
        masked.extend(bytes(len(text) - len(masked)))
        spans = f.spans(text, low, self.context)
        if spans and f.action == "stop":
            start = min(s for s, _ in spans)
            self.held, self.masked = "", bytearray()
            return text[:start], CONTENT_FILTER
        for start, end in spans:
            masked[start:end] = b"\x01" * (end - start)
        cut = len(text) if final else f.releasable(low)
        out = text[:cut]
        if masked.find(1, 0, cut) >= 0:
            out = "".join("*" if masked[i] else c for i, c in enumerate(out))
        self.held, self.masked = text[cut:], masked[cut:]
        if f.patterns and cut:
            self.context = (self.context + text[:cut])[-REGEX_CONTEXT:]
        return out, False


def output_filter(blocklist: Blocklist | None) -> OutputFilter | None:
    """The compiled filter, or None when there is nothing to block."""
    if blocklist is None or not (blocklist.terms or blocklist.patterns):
        return None
    return OutputFilter(blocklist)
