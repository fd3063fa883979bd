"""Segmented streaming (engine/output/segmenter.py): whole sentences or lines, however the text comes
(a leading space included: pysbd drops it from its segments)."""

from __future__ import annotations

import random

from inferd.engine.output.segmenter import LineHook, SentenceHook, segment_hook

TEXT = (' Hello world. This is Mr. Smith, who paid 3.5 dollars! Really? Yes.\nA new line here. '
        '你好。我很好！He said "Stop." Then... more. e.g. this one. End')
SENTENCES = [" Hello world. ", "This is Mr. Smith, who paid 3.5 dollars! ", "Really? ", "Yes.\n",
             "A new line here. ", "你好。", "我很好！", 'He said "Stop." ', "Then... more. ", "e.g. this one. ", "End"]


def deltas(hook: SentenceHook | LineHook, pieces: list[str]) -> list[str]:
    out = [hook(piece, i == len(pieces) - 1)[0] for i, piece in enumerate(pieces)]
    return [d for d in out if d]


def random_pieces(text: str, seed: int) -> list[str]:
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        k = rng.randint(1, 5)
        pieces.append(text[i:i + k])
        i += k
    return pieces


def cuts(parts: list[str]) -> set[int]:
    return {sum(map(len, parts[:i])) for i in range(1, len(parts) + 1)}


def test_sentences_whatever_the_pieces() -> None:
    for seed in range(20):  # one or more whole sentences per delta, however the text came
        out = deltas(SentenceHook(), random_pieces(TEXT, seed))
        assert "".join(out) == TEXT and cuts(out) <= cuts(SENTENCES), (seed, out)
    assert deltas(SentenceHook(), list(TEXT)) == SENTENCES


def test_an_open_sentence_waits_and_the_end_flushes() -> None:
    hook = SentenceHook()
    assert hook("Pi is 3.", False) == ("", False)  # a decimal, maybe
    assert hook("14. It", False) == ("Pi is 3.14. ", False)
    assert hook(" goes", False) == ("", False)
    assert hook(" on", True) == ("It goes on", False)


def test_lines() -> None:
    text = "first line\nsecond\n\nthird. still third\nend"
    for seed in range(5):
        assert deltas(LineHook(), random_pieces(text, seed)) in (
            ["first line\n", "second\n\n", "third. still third\n", "end"],
            ["first line\n", "second\n", "\n", "third. still third\n", "end"])
    assert segment_hook("token") is None and isinstance(segment_hook("line"), LineHook)
