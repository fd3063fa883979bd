"""A thinking budget: a thinking model's reasoning ended after so many tokens by its closing
marker, forced token by token, and the answer going on from there.

    <think>\\n  r1 r2 ... rN  </ think >  \\n\\n the answer
               └ N tokens ┘ └ forced  ┘
                (counted)    (once N are spent and the model has not closed it itself)

NOTE: an engine-level constraint, not an llguidance grammar: llguidance's `max_tokens` ends a
lexeme where it is, and its lexer is greedy, so "free text up to `</think>`, or N tokens of it
and then `</think>`" needs either backtracking (`stop=`), which the matcher does not do, or a
reasoning text barred from "<" (the greedy lexer commits at a marker's first byte). A grammar
for the content (one that lets the reasoning run free to its marker) is wrapped by this one:
its mask is narrowed to the forced token, and it is fed every token as before.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

State = Literal["before", "inside", "closing", "after"]


class ReasoningBudget:
    """One choice's thinking budget (a LogitsConstraint), over an optional inner constraint.

    `close_ids`: the tokens forced (the closing marker, with the newlines its template writes
    around it); `open`/`close`: the markers' bytes; `inside`: the
    prompt opened the reasoning block (else an answer that starts with `open` opens it, and one
    that does not never reasons). `token_bytes(id)`: a token's bytes (b"" for special ones)."""

    def __init__(self, budget: int, close_ids: Sequence[int], open: bytes, close: bytes, inside: bool,
                 token_bytes: Callable[[int], bytes], inner: Any = None) -> None:
        self.budget, self.close_ids, self.open, self.close = budget, list(close_ids), open, close
        self.token_bytes, self.inner = token_bytes, inner
        self.state: State = "inside" if inside else "before"
        self.spent = 0  # reasoning tokens so far
        self.forced = 0  # closing tokens written since the budget ran out
        self.seen = b""  # the bytes that may hold a marker: the answer's start, the reasoning's tail
        if self.state == "inside" and budget == 0:
            self.state = "closing"

    @property
    def matcher(self) -> Any:
        """The inner grammar's matcher (engine/structured/masks.py fills its mask in the batch)."""
        return getattr(self.inner, "matcher", None)

    def fill_mask(self, mask: np.ndarray) -> None:
        if self.inner is not None:
            self.inner.fill_mask(mask)
        else:
            mask[:] = -1
        self.narrow(mask)

    def narrow(self, mask: np.ndarray) -> None:
        """Once the budget is spent: only the closing marker's next token (int32 [ceil(V/32)])."""
        if self.state == "closing":
            token = self.close_ids[self.forced]
            mask[:] = 0
            mask.view(np.uint32)[token // 32] = np.uint32(1 << (token % 32))

    def check(self) -> None:
        if self.inner is not None and hasattr(self.inner, "check"):
            self.inner.check()

    def accept(self, token_id: int) -> bool:
        ended = bool(self.inner.accept(token_id)) if self.inner is not None else False
        if self.state == "closing":
            self.forced += 1
            if self.forced == len(self.close_ids):
                self.state = "after"
        elif self.state == "before":
            self.seen += self.token_bytes(token_id)
            text = self.seen.lstrip()
            if text.startswith(self.open):
                self.state, self.seen = "inside", text[len(self.open):]
                self._count(0)
            elif not self.open.startswith(text):
                self.state = "after"  # the answer does not reason
        elif self.state == "inside":
            self.seen += self.token_bytes(token_id)
            self._count(1)
        return ended

    def _count(self, tokens: int) -> None:
        """Reasoning tokens spent: closed by the model itself, or closing from the next token."""
        self.spent += tokens
        if self.close in self.seen:
            self.state = "after"
        elif self.spent >= self.budget and not _writing(self.seen, self.close):
            self.state = "closing"
        self.seen = self.seen[-len(self.close):]

    def fork(self) -> ReasoningBudget:
        twin = copy.copy(self)
        twin.inner = self.inner.fork() if self.inner is not None else None
        return twin


def _writing(seen: bytes, marker: bytes) -> bool:
    """Whether `seen` ends in the marker's first bytes: the model is closing it itself (a token or
    two past the budget, rather than a marker written over a half-written one)."""
    return any(seen.endswith(marker[:n]) for n in range(1, len(marker)))
