"""Incremental detokenization and stop checking, one `IncrementalDetokenizer` per sequence.

Text comes out as tokens arrive, with the read/prefix offset technique of vLLM and TGI:

    ids:   ... p p p | n n n | t
                     ^prefix ^read   (window = ids[prefix:], a few tokens long)

    prefix_text = decode(ids[prefix:read])      what the window already stood for
    full_text   = decode(ids[prefix:])          the same plus the new token(s)
    emit full_text[len(prefix_text):] unless it ends in U+FFFD (an incomplete UTF-8 character:
    wait for the next token); then prefix = read, read = len(ids).

Decoding a window rather than one token keeps SentencePiece's leading-space handling and
multi-token characters right, and costs O(window) per step, not O(output).

Stop strings: the emitted text never contains a stop string nor the start of one. New text is
appended to `pending`; a stop found there cuts the output before it; otherwise everything but the
longest suffix of `pending` that begins some stop string is emitted.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from inferd.text.sampling_params import SamplingParams
from inferd.text.tokenizer import Tokenizer

# prompt tokens decoded as context before the first generated one (vLLM uses the same 5)
_PROMPT_CONTEXT = 5

# decode([id]) per tokenizer, keyed by (id, skip_special_tokens) and shared by every sequence.
# NOTE: after a token is emitted the window is usually that one token, so the new prefix text is
# a lookup here instead of a second decode per step; bounded by twice the vocabulary.
_ONE_TOKEN_TEXT: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[int, bool], str]] = weakref.WeakKeyDictionary()


@dataclass
class DetokenizerUpdate:
    text: str  # new text to emit now (may be "")
    finished: bool  # a stop condition hit: EOS (unless ignore_eos), a stop token id, a stop string
    stop_reason: str | int | None  # the stop string matched, or the stop token id, else None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stops = tuple(s for s in params.stop if s)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.eos_ids = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
        self.finished = False
        self.stop_reason: str | int | None = None
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])  # the window: ids[prefix:]
        self._read = len(self._ids)  # window index of the first token not yet turned into text
        self._prefix_text = self._decode(self._ids)
        self._pending = ""  # decoded text held back: it may be the start of a stop string
        self._chunks: list[str] = []  # emitted text
        self._output: str | None = ""  # cache of "".join(_chunks)
        one = _ONE_TOKEN_TEXT.get(tokenizer)
        if one is None:
            one = _ONE_TOKEN_TEXT.setdefault(tokenizer, {})
        self._one_token_text = one

    @property
    def output_text(self) -> str:
        """Everything emitted so far."""
        if self._output is None:
            self._output = "".join(self._chunks)
        return self._output

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special) if ids else ""

    def _emit(self, text: str, finished: bool = False, reason: str | int | None = None) -> DetokenizerUpdate:
        if text:
            self._chunks.append(text)
            self._output = None
        if finished:
            self.finished, self.stop_reason = True, reason
        return DetokenizerUpdate(text, finished, reason)

    def step(self, token_id: int) -> DetokenizerUpdate:
        """Take the next generated token; return the text it releases and whether to stop."""
        if self.finished:
            return DetokenizerUpdate("", True, self.stop_reason)
        if token_id in self.stop_token_ids or token_id in self.eos_ids:
            # the stop token is not text; what was held back for stop strings is real output now
            text, self._pending = self._pending, ""
            return self._emit(text, True, token_id if token_id in self.stop_token_ids else None)

        self._ids.append(token_id)
        full_text = self._decode(self._ids)
        if len(full_text) <= len(self._prefix_text) or full_text.endswith("\ufffd"):
            return DetokenizerUpdate("", False, None)  # nothing new yet, or a character cut short
        new_text = full_text[len(self._prefix_text) :]
        del self._ids[: self._read]
        self._read = len(self._ids)
        if self._read == 1:
            key = (self._ids[0], self.skip_special)
            prefix_text = self._one_token_text.get(key)
            if prefix_text is None:
                prefix_text = self._one_token_text[key] = self._decode(self._ids)
            self._prefix_text = prefix_text
        else:
            self._prefix_text = self._decode(self._ids)
        if not self.stops:
            return self._emit(new_text)

        pending = self._pending + new_text
        cut = min(((i, s) for s in self.stops if (i := pending.find(s)) >= 0), default=None)
        if cut is not None:
            self._pending = ""
            return self._emit(pending[: cut[0]], True, cut[1])
        hold = self._stop_prefix_len(pending)
        self._pending = pending[len(pending) - hold :]
        return self._emit(pending[: len(pending) - hold])

    def _stop_prefix_len(self, text: str) -> int:
        """The length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """At the end for another reason (max_tokens, abort): the text held back, if any.

        Bytes of a character left incomplete at the end come out as U+FFFD, as a full decode gives.
        """
        if self.finished:
            return ""
        tail = ""
        if self._read < len(self._ids):
            tail = self._decode(self._ids)[len(self._prefix_text) :]
            del self._ids[: self._read]
            self._read = len(self._ids)
            self._prefix_text = self._decode(self._ids)
        text, self._pending = self._pending + tail, ""
        cut = min(((i, s) for s in self.stops if (i := text.find(s)) >= 0), default=None)
        if cut is not None:
            return self._emit(text[: cut[0]], True, cut[1]).text
        return self._emit(text).text
