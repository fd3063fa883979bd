"""Log probabilities in OpenAI's two shapes (completions and chat), from the engine's TokenLogprobs."""

from __future__ import annotations

import weakref
from typing import Any

from inferd.engine.protocol import TokenLogprob
from inferd.text.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # JSON has no -Infinity; a masked alternative reports this instead


class TokenTexts:
    """Token id -> (display text, UTF-8 bytes) for logprobs, cached per tokenizer (`token_texts`)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = weakref.ref(tokenizer)  # (the cache goes with its model's tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            tokenizer = self._tokenizer()
            assert tokenizer is not None  # (only called while its model answers)
            raw = tokenizer.token_bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit


_TOKEN_TEXTS: weakref.WeakKeyDictionary[Tokenizer, TokenTexts] = weakref.WeakKeyDictionary()


def token_texts(tokenizer: Tokenizer) -> TokenTexts:
    """The tokenizer's cache (one per loaded model; it goes with the model)."""
    texts = _TOKEN_TEXTS.get(tokenizer)
    if texts is None:
        texts = _TOKEN_TEXTS[tokenizer] = TokenTexts(tokenizer)
    return texts


def clamp_logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def completion_logprobs(token_text: TokenTexts, logprobs: list[TokenLogprob], offset: int) -> dict[str, list[Any]]:
    """OpenAI's completions shape; `offset` is where the first token starts in the choice's text."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for lp in logprobs:
        text = token_text(lp.token_id)[0]
        tokens.append(text)
        token_logprobs.append(clamp_logprob(lp.logprob))
        top_logprobs.append({token_text(t)[0]: clamp_logprob(v) for t, v in lp.top})
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def echo_logprobs(token_text: TokenTexts, prompt_ids: list[int], logprobs: list[TokenLogprob]) -> dict[str, list[Any]]:
    """The prompt in the completions shape (echo), vLLM's layout: its first token has no logprob
    and no alternatives (null); `logprobs` score tokens 1.. given the ones before them."""
    first = token_text(prompt_ids[0])[0]
    scored = completion_logprobs(token_text, logprobs, len(first))
    return {"tokens": [first, *scored["tokens"]], "token_logprobs": [None, *scored["token_logprobs"]],
            "top_logprobs": [None, *scored["top_logprobs"]], "text_offset": [0, *scored["text_offset"]]}


def chat_logprobs(token_text: TokenTexts, logprobs: list[TokenLogprob]) -> dict[str, list[Any]]:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for lp in logprobs:
        text, raw = token_text(lp.token_id)
        top = []
        for t, v in lp.top:
            top_text, top_raw = token_text(t)
            top.append({"token": top_text, "logprob": clamp_logprob(v), "bytes": top_raw})
        content.append({"token": text, "logprob": clamp_logprob(lp.logprob), "bytes": raw, "top_logprobs": top})
    return {"content": content}
