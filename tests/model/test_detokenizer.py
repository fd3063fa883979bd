"""Streaming text out of token ids: whole characters, hidden special tokens, stop conditions."""

from __future__ import annotations

import pytest

from inferd.text.detokenizer import IncrementalDetokenizer
from inferd.text.sampling_params import SamplingParams
from inferd.text.tokenizer import Tokenizer

STREAM_TEXT = (
    "Hello, wörld! 你好，世界。日本語 👨‍👩‍👧‍👦 🏳️‍🌈 🇩🇪🇯🇵 👍🏽 e\u0301 a\u0308\u0301 "
    "مرحبا بالعالم — Ελληνικά ₿ 🦀\n  def f(x): return x  # ok"
)
IM_START, IM_END, ENDOFTEXT = 1, 2, 0  # SmolLM2's control tokens


def stream(tok: Tokenizer, ids: list[int], params: SamplingParams | None = None, prompt_ids=()):
    """Feed ids one by one; return (pieces emitted per step, flush text, detokenizer, steps taken)."""
    detok = IncrementalDetokenizer(tok, params or SamplingParams(), prompt_ids)
    pieces = []
    for n, i in enumerate(ids, 1):
        update = detok.step(i)
        pieces.append(update.text)
        if update.finished:
            return pieces, "", detok, n
    return pieces, detok.flush(), detok, len(ids)


@pytest.fixture(params=["smollm", "spm"])
def tok(request) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tokenizer")


def test_streams_whole_characters(tok: Tokenizer, multilingual_text: str) -> None:
    for text in (STREAM_TEXT, multilingual_text):
        ids = tok.encode(text, add_special_tokens=False)
        pieces, tail, detok, _ = stream(tok, ids)
        assert "".join(pieces) + tail == text == detok.output_text
        assert not any("\ufffd" in p for p in pieces)
        held = sum(p == "" for p in pieces)
        assert held > 0  # some characters really span tokens (byte-level / byte fallback)
        assert len(detok._ids) < 12  # the decode window stays small: O(window) per step


def test_streams_after_a_prompt(tok: Tokenizer) -> None:
    """With prompt context the continuation keeps its leading space, as decode(prompt + output) has it."""
    prompt = tok.encode("Question: what now? Answer:")
    ids = tok.encode("Question: what now? Answer: Größe 😀 and 1 2", add_special_tokens=False)[len(prompt) - tok.add_bos :]
    pieces, tail, _, _ = stream(tok, ids, prompt_ids=prompt)
    full = tok.decode(prompt + ids)
    assert "".join(pieces) + tail == full[len(tok.decode(prompt)) :] == " Größe 😀 and 1 2"


def test_flush_of_a_cut_character(smollm_tokenizer: Tokenizer) -> None:
    ids = smollm_tokenizer.encode("ok 😀")
    pieces, tail, _, _ = stream(smollm_tokenizer, ids[:-1])  # the emoji's last byte never comes
    assert "".join(pieces) == "ok" and tail == smollm_tokenizer.decode(ids[:-1])[2:] and tail[0] == " "
    assert "\ufffd" in tail


def test_special_tokens_hidden_or_shown(smollm_tokenizer: Tokenizer) -> None:
    ids = smollm_tokenizer.encode("<|im_start|>assistant\nHi 😀<|im_start|>!")
    pieces, tail, _, _ = stream(smollm_tokenizer, ids)
    assert "".join(pieces) + tail == "assistant\nHi 😀!"
    pieces, tail, _, _ = stream(smollm_tokenizer, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(pieces) + tail == "<|im_start|>assistant\nHi 😀<|im_start|>!"


def test_stop_string_across_tokens(tok: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(text, add_special_tokens=False)
    pieces, tail, detok, steps = stream(tok, ids, SamplingParams(stop=("brown fox",)))
    assert detok.finished and detok.stop_reason == "brown fox" and tail == ""
    assert "".join(pieces) == detok.output_text == "The quick "
    # it stopped at the token that completes the stop string, not before or after
    assert "brown fox" in tok.decode(ids[:steps]) and "brown fox" not in tok.decode(ids[: steps - 1])


def test_stop_string_inside_a_token(smollm_tokenizer: Tokenizer) -> None:
    ids = smollm_tokenizer.encode("The quick brown fox")
    assert smollm_tokenizer.id_to_token(ids[2]) == "Ġbrown"
    pieces, _, detok, steps = stream(smollm_tokenizer, ids, SamplingParams(stop=("row",)))
    assert steps == 3 and detok.stop_reason == "row" and "".join(pieces) == "The quick b"


def test_stop_prefix_held_back_then_released(smollm_tokenizer: Tokenizer) -> None:
    params = SamplingParams(stop=("fox!", "zzz"))
    ids = smollm_tokenizer.encode("The fox jumps")
    pieces, tail, detok, _ = stream(smollm_tokenizer, ids, params)
    assert pieces == ["The", " ", "fox jumps"] and tail == "" and not detok.finished  # "fox" held a step
    # earliest stop wins; text held back is released when generation ends another way
    pieces, tail, detok, _ = stream(smollm_tokenizer, smollm_tokenizer.encode("a zzz fox! b"), params)
    assert detok.stop_reason == "zzz" and "".join(pieces) == "a "
    pieces, tail, detok, _ = stream(smollm_tokenizer, smollm_tokenizer.encode("say fox"), params)
    assert "".join(pieces) == "say " and tail == "fox" and detok.output_text == "say fox"


def test_stop_token_ids_and_eos(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    ids = tok.encode("Hi fox") + [IM_END] + tok.encode(" more")
    pieces, _, detok, steps = stream(tok, ids, SamplingParams(stop=("fox!",)))
    assert steps == 3 and detok.finished and detok.stop_reason is None  # EOS: no reason
    assert pieces == ["Hi", " ", "fox"] and detok.output_text == "Hi fox"  # held "fox" released

    pieces, _, detok, steps = stream(tok, tok.encode("Hi") + [ENDOFTEXT], SamplingParams())
    assert detok.finished and steps == 2  # <|endoftext|> ends generation too

    fox = tok.encode(" fox")[0]
    pieces, _, detok, steps = stream(tok, ids, SamplingParams(stop_token_ids=(fox,)))
    assert steps == 2 and detok.stop_reason == fox and detok.output_text == "Hi"

    pieces, tail, detok, steps = stream(tok, ids, SamplingParams(ignore_eos=True))
    assert steps == len(ids) and not detok.finished and "".join(pieces) + tail == "Hi fox more"
    pieces, tail, detok, _ = stream(tok, ids, SamplingParams(ignore_eos=True, skip_special_tokens=False))
    assert "".join(pieces) + tail == "Hi fox<|im_end|> more"

    update = detok.step(IM_END)  # ignore_eos: still running
    assert not update.finished
    detok = IncrementalDetokenizer(tok, SamplingParams())
    assert detok.step(IM_END).finished and detok.step(tok.encode("x")[0]).finished  # stays finished


def test_spm_eos_and_leading_space(spm_tokenizer: Tokenizer) -> None:
    tok = spm_tokenizer
    ids = tok.encode("Hello world", add_special_tokens=False) + [2]
    pieces, _, detok, steps = stream(tok, ids, prompt_ids=[1])
    assert detok.finished and steps == len(ids) and "".join(pieces) == "Hello world"
