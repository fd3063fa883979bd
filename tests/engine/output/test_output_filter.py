"""The streaming output filter (engine/output/blocklist.py) as a hook, piece by piece: no character of
a blocked term is ever released unmasked, however the text is split; and through the output
processor on the real tokenizer, where "stop" ends a choice with "content_filter"."""

from __future__ import annotations

import itertools
import random
import string
from pathlib import Path

import pytest

from inferd.settings.config import load_settings

from inferd.settings.values import SettingsError
from inferd.engine.config import EngineConfig
from inferd.engine.output.blocklist import Blocklist, OutputFilter, output_filter, read_blocklist
from inferd.engine.output.processor import OutputProcessor
from inferd.engine.sched.request import Request, RequestStatus
from inferd.model.loading.loader import default_model_path
from inferd.model.sampler import SamplerOutput
from inferd.text.sampling_params import SamplingParams
from inferd.text.tokenizer import Tokenizer
from inferd.text.tokenizer_loader import load_tokenizer


def stream(f: OutputFilter, pieces: list[str]) -> tuple[list[str], bool | str]:
    """The prefixes of the released text after each piece (the last piece is final), and the stop."""
    hook, released, prefixes = f.hook(), "", []
    for i, piece in enumerate(pieces):
        text, stop = hook(piece, i == len(pieces) - 1)
        released += text
        prefixes.append(released)
        if stop:
            return prefixes, stop
    return prefixes, False


def splits(text: str, parts: int) -> list[list[str]]:
    """Every way to cut `text` into `parts` non-empty pieces."""
    return [[text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)))]
            for cuts in itertools.combinations(range(1, len(text)), parts - 1)]


TEXT = "We said the Secret Word twice: secret word!"
MASKED = "We said the *********** twice: ***********!"


@pytest.mark.parametrize("parts", [2, 3])
def test_a_term_split_anywhere_is_never_released(parts: int) -> None:
    masking = OutputFilter(Blocklist(("secret word",), ()))
    stopping = OutputFilter(Blocklist(("secret word",), (), "stop"))
    for pieces in splits(TEXT, parts):
        prefixes, stop = stream(masking, pieces)
        assert not stop and prefixes[-1] == MASKED, pieces
        assert all(MASKED.startswith(p) for p in prefixes), pieces  # nothing unmasked, ever
        prefixes, stop = stream(stopping, pieces)
        assert stop == "content_filter" and prefixes[-1] == "We said the ", pieces
        assert all("We said the ".startswith(p) for p in prefixes), pieces


def test_case_insensitive_and_one_character_pieces() -> None:
    f = OutputFilter(Blocklist(("DaNgEr",), ()))
    prefixes, _ = stream(f, list("no danger, DANGER or Danger here"))
    assert prefixes[-1] == "no ******, ****** or ****** here"
    assert not any("d" in p.lower().replace("do", "") for p in prefixes[:3])  # "d" held until decided


def test_overlapping_and_nested_terms() -> None:
    f = OutputFilter(Blocklist(("foo", "foobar", "barbaz", "oba"), ()))
    for pieces in splits("a foobarbaz b", 3):
        prefixes, _ = stream(f, pieces)
        assert prefixes[-1] == "a ********* b", pieces
        assert all("a ********* b".startswith(p) for p in prefixes), pieces
    # "foo" complete but maybe the start of "foobar": held, then masked as "foo" alone
    assert stream(f, ["foo", "d"])[0] == ["", "***d"]
    stop = OutputFilter(Blocklist(("foo", "foobar", "barbaz"), (), "stop"))
    assert stream(stop, ["x fo", "obarbaz y"]) == (["x ", "x "], "content_filter")  # at "foo", the earliest


def test_random_terms_and_splits_against_an_offline_mask() -> None:
    rng = random.Random(1)
    for _ in range(500):
        terms = tuple({"".join(rng.choices("abAB", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 4))})
        text = "".join(rng.choices("abAB c", k=rng.randint(1, 20)))
        hidden = [any(text.lower().startswith(t.lower(), s) for t in terms for s in range(max(0, i - len(t) + 1), i + 1))
                  for i in range(len(text))]
        expected = "".join("*" if h else c for h, c in zip(hidden, text))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        prefixes, _ = stream(OutputFilter(Blocklist(terms, ())), pieces)
        assert prefixes[-1] == expected and all(expected.startswith(p) for p in prefixes), (terms, pieces)


def test_regex_terms_with_word_boundaries() -> None:
    f = OutputFilter(Blocklist(("zz",), (r"\bass\b", r"\d{3}-\d{4}")))
    assert f.regex_hold == 7  # the longest pattern's width less one
    text = "class is fine; an ass is not; call 555-1234 now"
    expected = "class is fine; an *** is not; call ******** now"
    for pieces in splits(text, 2) + [list(text)]:
        prefixes, _ = stream(f, pieces)
        assert prefixes[-1] == expected, pieces
        assert all(expected.startswith(p) for p in prefixes), pieces
    stop = OutputFilter(Blocklist((), (r"\d{3}-\d{4}",), "stop"))
    assert stream(stop, list("call 555-1234 now"))[0][-1] == "call "


def test_unbounded_regex_is_held_a_window() -> None:
    f = OutputFilter(Blocklist((), (r"bad\w*",)))
    assert f.regex_hold == 63
    prefixes, _ = stream(f, ["it was badly", " done and that is all, really all of it, there is nothing more", "."])
    assert prefixes[0] == "" and prefixes[-1].startswith("it was ***** done")


def test_held_text_is_released_at_final() -> None:
    f = OutputFilter(Blocklist(("secretive",), ()))
    hook = f.hook()
    assert hook("a secre", False) == ("a ", False)  # "secre" may start the term
    assert hook("t", True) == ("secret", False)  # the end: it never did
    hook = f.hook()
    assert hook("a secre", False) == ("a ", False)
    assert hook("tive", True) == ("*********", False)


def test_ten_thousand_terms() -> None:
    rng = random.Random(0)
    words = {"elephant", "quantum", "marmalade"}
    while len(words) < 10_000:
        words.add("".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 12))))
    terms = tuple(words)
    f = OutputFilter(Blocklist(terms, ()))
    text = "The Elephant ate marmalade while quantum physicists watched."
    prefixes, _ = stream(f, [text[i:i + 3] for i in range(0, len(text), 3)])
    out = prefixes[-1]
    assert "********" in out and "*********" in out and "*******" in out
    assert "elephant" not in out.lower() and "marmalade" not in out and "quantum" not in out
    assert all(out.startswith(p) for p in prefixes)


def test_blocklist_file(tmp_path: Path) -> None:
    path = tmp_path / "blocklist.txt"
    path.write_text("# a comment\n\n  spoon  \nre:\\bfork\\b\nknife # not a comment\n")
    assert read_blocklist(str(path), "stop") == Blocklist(("spoon", "knife # not a comment"), (r"\bfork\b",), "stop")
    path.write_text("ok\nre:(unclosed\n")
    with pytest.raises(SettingsError, match="line 2: invalid regular expression"):
        read_blocklist(str(path))
    path.write_text("ok\n\nre:x*\n")
    with pytest.raises(SettingsError, match="line 3: .*empty"):
        read_blocklist(str(path))
    with pytest.raises(SettingsError, match="cannot read"):
        read_blocklist(str(tmp_path / "missing.txt"))
    path.write_text("spoon\n")
    settings = load_settings(None, {"output_filter": {"blocklist_file": str(path), "action": "stop"}}, environ={})
    assert EngineConfig.from_settings(settings).output_filter == Blocklist(("spoon",), (), "stop")
    assert EngineConfig.from_settings(load_settings(None, environ={})).output_filter is None
    assert output_filter(Blocklist((), ())) is None


# ------------------------------------------------------------------ through the output processor


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


def run(processor: OutputProcessor, seq: Request, tokens: list[int]) -> tuple[list[str], str | None]:
    deltas, ending = [], None
    for token in tokens:
        seq.output_ids.append(token)
        out, ending = processor.on_token(seq, token, SamplerOutput([token], None, None), 0)
        deltas.append(out.text)
        if ending is not None:
            break
    return deltas, ending


def test_through_the_output_processor(tokenizer: Tokenizer) -> None:
    text = " The unbelievable story of an unbelievably tall giraffe."
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokenizer.encode(" unbelievable", add_special_tokens=False)) >= 2
    masking = OutputProcessor(tokenizer, output_filter(Blocklist(("unbelievab",), ())))
    seq = Request(0, [1], SamplingParams(max_tokens=len(tokens)), 8192)
    masking.add(seq, masking.hooks())
    deltas, ending = run(masking, seq, tokens)
    assert "".join(deltas) == " The **********le story of an **********ly tall giraffe." and ending == "length"
    stopping = OutputProcessor(tokenizer, output_filter(Blocklist(("UNBELIEVAB",), (), "stop")))
    seq = Request(1, [1], SamplingParams(max_tokens=100), 8192)
    stopping.add(seq, stopping.hooks("sentence"))  # the segmenter after the filter releases at the stop
    deltas, ending = run(stopping, seq, tokens)
    assert ending == "content_filter" and "".join(deltas) == " The "
    assert RequestStatus.FINISHED_FILTERED.finished
    assert RequestStatus.FINISHED_FILTERED.finish_reason == "content_filter"
