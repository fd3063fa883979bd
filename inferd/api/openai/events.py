"""The streamed chunks of an OpenAI answer: whole events, and the JSON head that per-token events
are written from (only the choice's fields after it vary)."""

from __future__ import annotations

from typing import Any

from inferd.api.streaming.sse import dumps


class StreamEvents:
    """The payloads of one streamed response (chat.completion.chunk or text_completion)."""

    def __init__(self, object_name: str, completion_id: str, created: int, model: str) -> None:
        self._base = {"id": completion_id, "object": object_name, "created": created, "model": model}
        self.token_head = dumps({**self._base, "choices": []})[: -len("[]}")] + '[{"index":'

    def event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        payload = {**self._base, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return payload

    def token_event(self, index: int, content: str, finish_reason: str | None) -> str:
        """One choice's per-token event without logprobs, as JSON text; `content` is its
        `"text":...` or `"delta":...` member, already JSON."""
        return f'{self.token_head}{index},{content},"logprobs":null,"finish_reason":{dumps(finish_reason)}}}]}}'
