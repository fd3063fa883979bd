"""Grammar-constrained decoding through llguidance: what a structured-output request compiles to.

    response_format / tool_choice  --door-->  grammar text  --compile-->  GrammarConstraint
    engine step: engine/structured/masks.py fills every constrained row's allowed tokens as a bitmask
                 while the model runs -> the sampler masks the logits -> accept(the token)

llguidance (a Rust core, no Python dependencies) was chosen over xgrammar, which pulls torch,
transformers and triton into what the API imports; llguidance builds its token trie from our own
tokenizer in ~0.2 s and fills a next-token mask in ~15-30 µs (bench/structured.py).
No torch here: the API compiles grammars (a bad one is the client's 400).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np

from inferd.engine.protocol import ConstraintError
from inferd.engine.structured.repeats import RepeatedSpanStop
from inferd.text.tokenizer import Tokenizer

# Compact, single-line JSON with the usual separators: no run of whitespace for a sampling model
# to wander into, and the shape models saw most in training.
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot compile; the message says why."""


def json_schema_grammar(schema: dict[str, Any], *, strict: bool = True) -> str:
    """A JSON schema's grammar. `strict`: a keyword llguidance does not implement is an error
    (else it is ignored, as OpenAI's non-strict mode does)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={**JSON_LAYOUT, "lenient": not strict})
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


# OpenAI's json_object mode, bounded: a sampling model (temperature 1) otherwise wanders into
# keys and strings that never close and is cut by max_tokens (6 of 40 seeds of the default model
# at 1,000 tokens). With 64-character strings all 40 closed within 691 tokens; with these bounds
# the 20 seeds of tests/e2e/test_structured_outputs.py close within 1,000. json_schema has none.
JSON_OBJECT_MEMBERS = 8  # per object or array
JSON_OBJECT_KEY_CHARS = 32
JSON_OBJECT_STRING_CHARS = 128
JSON_OBJECT_DEPTH = 3  # objects and arrays, the outer object included


def _json_value(depth: int) -> dict[str, Any]:
    scalars: list[dict[str, Any]] = [{"type": "string", "maxLength": JSON_OBJECT_STRING_CHARS},
                                     {"type": "number", "minimum": -1e15, "maximum": 1e15},
                                     {"type": "boolean"}, {"type": "null"}]
    if depth == 0:
        return {"anyOf": scalars}
    inner = _json_value(depth - 1)
    return {"anyOf": [*scalars, {"type": "array", "items": inner, "maxItems": JSON_OBJECT_MEMBERS}, _json_object(inner)]}


def _json_object(values: dict[str, Any]) -> dict[str, Any]:
    key = f'^[^"\\\\\\x00-\\x1f]{{1,{JSON_OBJECT_KEY_CHARS}}}$'  # no quote, backslash or control character
    return {"type": "object", "patternProperties": {key: values}, "additionalProperties": False,
            "maxProperties": JSON_OBJECT_MEMBERS}


def json_object_grammar() -> str:
    """A JSON object (OpenAI's `json_object` mode), within the bounds above."""
    return json_schema_grammar(_json_object(_json_value(JSON_OBJECT_DEPTH - 1)))


def regex_grammar(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: Sequence[str]) -> str:
    """Exactly one of these strings."""
    return llguidance.LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in choices))


def lark_grammar(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


class _TokenizerView:
    """Our tokenizer as llguidance's TokenizerWrapper reads one: every token's bytes (special
    tokens marked by a leading 0xFF, llguidance's convention) and an encode function."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        if not tokenizer.eos_token_ids:  # (a grammar ends the answer by allowing only EOS)
            raise GrammarError("the model's tokenizer names no end-of-sequence token, which a grammar needs")
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self.tokens = [b"\xff" + tokenizer.id_to_token(i).encode() if i in tokenizer.special_ids
                       else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        # A SentencePiece vocabulary puts a space ("▁") before a text's first word, but llguidance
        # encodes text that a grammar forces in the middle of an answer: encoded after a newline
        # (which no piece merges with), whose ids are then dropped, it gets no space
        first = tokenizer.encode("a", add_special_tokens=False)
        spaced = bool(first) and tokenizer.token_bytes(first[0]).startswith(b" ")
        self._newline = tokenizer.encode("\n", add_special_tokens=False) if spaced else []

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # tells TokenizerWrapper to pass str, not bytes
        if self._newline:
            ids = self._tokenizer.encode("\n" + text, add_special_tokens=False)
            if ids[:len(self._newline)] == self._newline:
                return ids[len(self._newline):]
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Compiles grammar text into per-request constraints for one model's tokenizer. Thread-safe:
    the door compiles off the event loop (a large schema takes milliseconds)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size  # the model's: its logits may be padded
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._token_bytes: list[bytes] = []  # id -> its bytes, as llguidance sees them

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once, on first use (~0.2 s)
            if self._lltokenizer is None:
                view = _TokenizerView(self._tokenizer)
                self._token_bytes = view.tokens + [b""] * (self.vocab_size - len(view.tokens))
                self._lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view),
                                                           n_vocab=self.vocab_size,
                                                           eos_token=sorted(self._tokenizer.eos_token_ids))
            return self._lltokenizer

    def compile(self, grammar: str, repeat_tags: tuple[str, str] | None = None,
                best_effort: bool = False) -> GrammarConstraint:
        """A fresh constraint for one choice; GrammarError if the grammar does not compile, or
        fails at its first token (a limit llguidance meets building it, a language with no
        first token): a grammar refused here never reaches the engine. With `repeat_tags`
        (opening, closing), the choice ends once a span between them repeats an earlier one;
        `best_effort`: a grammar that breaks later lets the choice go on unconstrained."""
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        probe, mask = matcher.deep_copy(), np.zeros((self.vocab_size + 31) // 32, np.int32)
        probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if probe.is_error() or not mask.any():
            raise GrammarError(probe.get_error() or "no token can start it")
        repeats = RepeatedSpanStop(*repeat_tags, self._token_bytes) if repeat_tags else None
        return GrammarConstraint(matcher, repeats, best_effort)


class GrammarConstraint:
    """One choice's grammar state (a LogitsConstraint). The engine thread alone drives it.

    A `best_effort` one (tool calls under tool_choice "auto": the client asked for no
    constraint) that breaks lets go instead of failing the choice: `matcher` becomes None and
    every token is allowed from then on."""

    def __init__(self, matcher: llguidance.LLMatcher | None, repeats: RepeatedSpanStop | None = None,
                 best_effort: bool = False) -> None:
        self.matcher = matcher
        self.repeats = repeats
        self.best_effort = best_effort

    def fill_mask(self, mask: np.ndarray) -> None:
        """Write the allowed next tokens into `mask` (int32 [ceil(V/32)], bit i = token i)."""
        if self.matcher is not None:
            self.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            self.check()
        if self.matcher is None:
            mask[:] = -1

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; True when the choice ends here (it repeated a tagged span)."""
        if self.matcher is not None and not self.matcher.consume_token(token_id):
            self._fail(f"the grammar refused token {token_id}: {self.matcher.get_error()}")
        return self.repeats is not None and self.repeats.feed(token_id)

    def fork(self) -> GrammarConstraint:
        return GrammarConstraint(self.matcher.deep_copy() if self.matcher is not None else None,
                                 self.repeats.fork() if self.repeats else None, self.best_effort)

    def check(self) -> None:
        """Raise if the matcher broke (a token it could not take, a resource limit); a best-effort
        constraint lets go instead."""
        if self.matcher is not None and self.matcher.is_error():
            self._fail(f"the grammar failed: {self.matcher.get_error()}")

    def _fail(self, message: str) -> None:
        if not self.best_effort:
            raise ConstraintError(message)
        self.matcher = None
