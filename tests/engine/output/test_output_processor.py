"""The output processor on the real SmolLM2 tokenizer: text deltas, stops, lengths, and the
per-choice hooks where output filters plug in."""

from __future__ import annotations

import pytest

from inferd.engine.output.processor import OutputProcessor
from inferd.engine.sched.request import Request
from inferd.model.loading.loader import default_model_path
from inferd.model.sampler import SamplerOutput
from inferd.text.sampling_params import SamplingParams
from inferd.text.tokenizer import Tokenizer
from inferd.text.tokenizer_loader import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


def feed(processor: OutputProcessor, seq: Request, tokens: list[int]) -> tuple[str, str | None, int]:
    """Every token through the processor as the engine would: (text, how it ended, tokens used)."""
    text, ending = "", None
    for used, token in enumerate(tokens, 1):
        seq.output_ids.append(token)
        out, ending = processor.on_token(seq, token, SamplerOutput([token], None, None), 0)
        text += out.text
        if ending is not None:
            return text, ending, used
    return text, ending, len(tokens)


class Redact:
    """A hook that replaces a word with asterisks, holding back text that may start it."""

    def __init__(self, word: str) -> None:
        self.word, self.held = word, ""

    def __call__(self, text: str, final: bool) -> tuple[str, bool]:
        text = (self.held + text).replace(self.word, "*" * len(self.word))
        keep = 0 if final else max((k for k in range(1, len(self.word)) if text.endswith(self.word[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False


class StopAt:
    def __init__(self, word: str) -> None:
        self.word = word

    def __call__(self, text: str, final: bool) -> tuple[str, bool]:
        return text, self.word in text


def test_text_stops_and_lengths(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(" the cat sat on the mat. Then it slept.", add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    plain = Request(0, [1, 2], SamplingParams(max_tokens=100), 8192)
    processor.add(plain)
    assert feed(processor, plain, tokens) == (" the cat sat on the mat. Then it slept.", None, len(tokens))
    stopped = Request(1, [1, 2], SamplingParams(max_tokens=100, stop=(" on",)), 8192)
    processor.add(stopped)
    assert feed(processor, stopped, tokens)[:2] == (" the cat sat", "stop")
    short = Request(2, [1, 2], SamplingParams(max_tokens=3), 8192)
    processor.add(short)
    assert feed(processor, short, tokens) == (tokenizer.decode(tokens[:3]), "length", 3)


def test_hooks_see_every_delta_and_may_stop_the_choice(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(" the cat sat on the mat with another cat.", add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    masked = Request(0, [1, 2], SamplingParams(max_tokens=len(tokens)), 8192)
    processor.add(masked, [Redact("cat")])
    text, ending, _ = feed(processor, masked, tokens)
    assert (text, ending) == (" the *** sat on the mat with another ***.", "length")
    halted = Request(1, [1, 2], SamplingParams(max_tokens=100), 8192)
    processor.add(halted, [StopAt("mat")])
    text, ending, used = feed(processor, halted, tokens)
    assert ending == "stop" and text.endswith("mat") and used < len(tokens)
    processor.remove(0)
    processor.remove(1)
    assert processor.flush(0) == ""
