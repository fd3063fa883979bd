"""The stop on a repeated tool call (engine/structured/repeats.py), on hand-made token bytes."""

from __future__ import annotations

from inferd.engine.structured.repeats import RepeatedSpanStop

CALL = "<tool_call>{}</tool_call>"


def feed(stop: RepeatedSpanStop, pieces: list[str], vocab: dict[str, int]) -> list[bool]:
    return [stop.feed(vocab[p]) for p in pieces]


def watcher(pieces: list[str]) -> tuple[RepeatedSpanStop, dict[str, int]]:
    vocab = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
    table = [p.encode() for p in vocab]
    return RepeatedSpanStop("<tool_call>", "</tool_call>", table), vocab


def test_the_first_repeat_ends_the_answer_on_its_last_token() -> None:
    a = ["Hi <", "tool", "_call>", '{"a"', ": 1}", "</tool", "_call>"]
    b = ["\n<tool_call>", '{"a": 2}', "</tool_call>"]
    pieces = a + b + ["\n"] + a
    stop, vocab = watcher(pieces)
    ends = feed(stop, pieces, vocab)
    assert ends == [False] * (len(pieces) - 1) + [True]


def test_tags_split_across_tokens_and_several_in_one_token() -> None:
    text = CALL.replace("{}", '{"x": 1}') * 2
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    stop, vocab = watcher(pieces)
    assert feed(stop, pieces, vocab)[-1] is True
    both, vocab = watcher([text])
    assert both.feed(vocab[text]) is True  # two calls in one token: the second repeats the first


def test_other_spans_and_plain_text_go_on() -> None:
    pieces = [CALL.replace("{}", '{"x": 1}'), " <tool_call", " not a call", CALL.replace("{}", '{"x": 2}'), "</tool_call>"]
    stop, vocab = watcher(pieces)
    assert not any(feed(stop, pieces, vocab))


def test_a_fork_keeps_its_own_state() -> None:
    pieces = [CALL]
    stop, vocab = watcher(pieces)
    twin = stop.fork()
    assert stop.feed(vocab[CALL]) is False and stop.feed(vocab[CALL]) is True
    assert twin.feed(vocab[CALL]) is False
