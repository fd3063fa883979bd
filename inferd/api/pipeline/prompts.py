"""A request's prompts, made without holding the event loop: the model's tokenizer as a
front-end sees it, refusing a text too long for the context from its size alone, and the
work on a big body done on a worker thread (api/offload.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from inferd.api.errors import bad_request
from inferd.api.offload import OFFLOAD
from inferd.text.tokenizer import Tokenizer

T = TypeVar("T")  # what a shape makes with its prompts


class PromptTokenizer:
    """`tokenizer`, whose `encode` refuses (400 context_length_exceeded) a text whose size alone
    shows it has at least `context` tokens, before any tokenizing; the rest is the tokenizer's."""

    def __init__(self, tokenizer: Tokenizer, context: int) -> None:
        self._tokenizer = tokenizer
        self._context = context

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        size = len(text.encode("utf-8", "surrogatepass"))
        least = size // self._tokenizer.bytes_per_token_bound
        if least >= self._context:
            raise bad_request(f"the prompt ({size} bytes) has at least {least} tokens; this model's context is "
                              f"{self._context} tokens", code="context_length_exceeded")
        return self._tokenizer.encode(text, add_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


async def make_prompts(request: web.Request, tokenizer: Tokenizer, context: int, make: Callable[[Tokenizer], T]) -> T:
    """`make(tokenizer)`: the request's prompts (rendering and tokenizing, and what comes with them),
    sized-checked, and on a worker thread when its body is big."""
    size = request.content_length if request.content_length is not None else len(await request.read())
    guarded: Any = PromptTokenizer(tokenizer, context)
    return await request.app[OFFLOAD].run(size, lambda: make(guarded))
