"""The streamed chunks of an OpenAI answer: whole events, and the JSON head that per-token events
are written from (only the choice's fields after it vary)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inferd.api.streaming.generation import Render
from inferd.api.streaming.sse import dumps
from inferd.engine.protocol import EngineOutput


class StreamEvents:
    """The payloads of one streamed response (chat.completion.chunk or text_completion)."""

    def __init__(self, object_name: str, completion_id: str, created: int, model: str) -> None:
        self._base = {"id": completion_id, "object": object_name, "created": created, "model": model}
        self.token_head = dumps({**self._base, "choices": []})[: -len("[]}")] + '[{"index":'

    def event(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        payload = {**self._base, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return payload

    def token_event(self, index: int, content: str, finish_reason: str | None) -> str:
        """One choice's per-token event without logprobs, as JSON text; `content` is its
        `"text":...` or `"delta":...` member, already JSON."""
        return f'{self.token_head}{index},{content},"logprobs":null,"finish_reason":{dumps(finish_reason)}}}]}}'


def with_usage(render: Render, usage: Callable[[], dict[str, Any]]) -> Render:
    """`stream_options.continuous_usage_stats`: every chunk carries the usage so far (vLLM's)."""

    def render_with_usage(prompt: int, out: EngineOutput) -> dict[str, Any] | str:
        payload = render(prompt, out)
        if isinstance(payload, str):  # a per-token event's JSON text: the member goes before its last brace
            return f'{payload[:-1]},"usage":{dumps(usage())}}}'
        return {**payload, "usage": usage()}

    return render_with_usage
