"""Ends an answer that repeats a tagged span: a tool call made twice in one turn.

A small model offered "one more call" tends to make the same call again and again. A grammar
cannot refuse a repeat (it would have to know the call ends identically before the model has
written it), so the choice is ended instead, right after the first repeat: the API drops that
repeat from the reply (conversation/tools.py), and the client sees each call once.

    output bytes:  ...text <tool_call>{A}</tool_call>\\n<tool_call>{A}</tool_call>
                                      └ span 1 ┘                  └ span 2 = span 1: end here

No torch, no tokenizer: the token bytes come from the grammar compiler.
"""

from __future__ import annotations

from collections.abc import Sequence


class RepeatedSpanStop:
    """Watches one choice's output for spans between `opening` and `closing` (exact bytes) and
    says when a span just closed that equals an earlier one, byte for byte (under a grammar the
    layout is pinned, so the same call is the same bytes)."""

    def __init__(self, opening: str, closing: str, token_bytes: Sequence[bytes]) -> None:
        self._opening, self._closing = opening.encode(), closing.encode()
        self._token_bytes = token_bytes  # id -> the bytes it adds to the text (shared, read-only)
        self._pending = bytearray()  # output not yet matched: a tail that may start the opening, or an open span
        self._in_span = False
        self._seen: set[bytes] = set()

    def fork(self) -> RepeatedSpanStop:
        twin = RepeatedSpanStop("", "", self._token_bytes)
        twin._opening, twin._closing = self._opening, self._closing
        twin._pending, twin._in_span, twin._seen = bytearray(self._pending), self._in_span, set(self._seen)
        return twin

    def feed(self, token_id: int) -> bool:
        """Take the next sampled token; True when a span that repeats an earlier one has just closed."""
        self._pending += self._token_bytes[token_id]
        while True:
            tag = self._closing if self._in_span else self._opening
            at = self._pending.find(tag)
            if at < 0:
                if not self._in_span:  # keep only a tail that could still grow into the opening
                    del self._pending[: max(0, len(self._pending) - len(tag) + 1)]
                return False
            if self._in_span:
                span = bytes(self._pending[:at])
                if span in self._seen:
                    return True
                self._seen.add(span)
            del self._pending[: at + len(tag)]
            self._in_span = not self._in_span
