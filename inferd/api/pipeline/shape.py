"""What a protocol front-end gives the shared path: how one request's body becomes prompts, and
how its answer is shaped in the front-end's wire format (pipeline/__init__.py has the contract)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from inferd.api.admission.ask import Shaped
from inferd.api.streaming.generation import ChoiceResult, Render
from inferd.api.streaming.resume import EventLog
from inferd.api.streaming.sse import Dialect, Payload
from inferd.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Reply:
    """The answer's identity and accounts, as the shared path hands them to the front-end."""

    id: str  # the response's id: the front-end's prefix and a uuid
    created: int  # unix seconds
    model: str  # the model that answered (a route's or a fallback's target, not the name asked)
    tokenizer: Tokenizer  # that model's
    usage: Callable[[], dict[str, Any]]  # prompt_tokens, completion_tokens, total_tokens (and details) so far


@dataclass(frozen=True)
class Events:
    """A streamed answer's events: `head` first, `render(prompt, output)` per engine output (one
    event or several), `tail()` once every choice has ended (not after an engine abort), then the
    end of the stream; or, with `background`, the same events into a log that outlives the request."""

    head: list[Payload]
    render: Render
    tail: Callable[[], list[Payload]]
    dialect: Dialect = Dialect()  # an error mid-stream in the protocol's shape, and the stream's end
    # a background response (the Responses API's): the events go into an EventLog that nobody
    # is attached to yet, produced by a task of their own; this gets the log and answers the
    # request at once (with the response as it starts, or by following the log)
    background: Callable[[EventLog], Awaitable[web.StreamResponse]] | None = None
    per_token: int = 1  # the most events one generated token makes (what bounds a background log)


class Shape(Protocol):
    """One request's front-end: made from its parsed body, asked by the shared path."""

    id_prefix: str  # of the response id ("cmpl", "chatcmpl", ...)

    def prepare(self, tokenizer: Tokenizer, max_prompts: int) -> Shaped:
        """For the model of `tokenizer`, in one call: the token ids of each prompt (a 400 for a
        batch over `max_prompts`), the grammar its answer is held to (or the 400 building it
        gave, as Refused: the door gives it in its turn), its thinking budget. The shape keeps how
        the answer is written (its AnswerFormat) for `whole` and `stream`."""
        ...

    def prompt_text(self, tokenizer: Tokenizer, prompts: list[list[int]]) -> str:
        """The prompt as text, for the log line and the request file (asked only when they want it)."""
        ...

    def whole(self, reply: Reply, results: dict[int, ChoiceResult]) -> dict[str, Any]:
        """A non-streamed answer's JSON body, from every choice's result (by choice index)."""
        ...

    def stream(self, reply: Reply) -> Events:
        """A streamed answer's events."""
        ...
