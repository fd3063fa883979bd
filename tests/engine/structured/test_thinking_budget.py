"""The thinking budget's constraint on fabricated tokens: it counts the reasoning, forces the
closing marker once the budget is spent, and lets a reasoning closed in time (or an answer that
does not reason) go free."""

from __future__ import annotations

import numpy as np

from inferd.engine.structured.budget import ReasoningBudget

VOCAB = [b"a", b" b", b"</", b"think", b">", b"\n", b"<think>", b"\n\n"]
A, B, SLASH, THINK, GT, NL, OPEN, NLNL = range(len(VOCAB))
CLOSING = [NL, SLASH, THINK, GT, NLNL]  # "\n</think>\n\n", as the template writes it


def budget(n: int, inside: bool = True) -> ReasoningBudget:
    return ReasoningBudget(n, CLOSING, b"<think>", b"</think>", inside, VOCAB.__getitem__)


def allowed(constraint: ReasoningBudget) -> list[int]:
    mask = np.zeros(1, np.int32)  # [ceil(V/32)]
    constraint.fill_mask(mask)
    return [t for t in range(len(VOCAB)) if mask.view(np.uint32)[0] >> t & 1]


def test_the_budget_forces_the_closing_marker_at_its_count() -> None:
    constraint = budget(2)
    for token in (A, B):
        assert len(allowed(constraint)) == len(VOCAB)
        constraint.accept(token)
    twin = constraint.fork()
    for token in CLOSING:
        assert allowed(constraint) == [token]
        constraint.accept(token)
    assert len(allowed(constraint)) == len(VOCAB) and constraint.spent == 2
    assert allowed(twin) == [NL]  # (a fork goes its own way)


def test_a_reasoning_closed_in_time_or_none_at_all_goes_free() -> None:
    closed = budget(2)  # (its marker goes past the budget: the model is writing it)
    for token in (A, SLASH, THINK, GT, A, B, A):
        assert len(allowed(closed)) == len(VOCAB)
        closed.accept(token)
    plain = budget(1, inside=False)
    for token in (A, B, A):
        assert len(allowed(plain)) == len(VOCAB)
        plain.accept(token)


def test_an_answer_that_opens_its_reasoning_and_a_zero_budget() -> None:
    opened = budget(1, inside=False)
    for token in (NL, OPEN, A):
        opened.accept(token)
    assert allowed(opened) == [NL]
    assert allowed(budget(0)) == [NL]
