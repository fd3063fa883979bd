"""A response's streamed events, each numbered by `sequence_number` (the event's index in its
stream, also its SSE id `<response id>:<n>`, so a replay from `starting_after=N` is events N+1..):

    response.created, response.in_progress
    per output item: response.output_item.added, (a thinking model's reasoning, first)
        response.reasoning_text.delta..., response.reasoning_text.done,
        (a message) response.content_part.added,
        response.output_text.delta..., response.output_text.done, response.content_part.done
        (a function call) response.function_call_arguments.delta..., .done
        response.output_item.done
    response.completed (or response.incomplete) with the whole response

A background response that is cancelled, or evicted while it runs, ends with an `error` event
instead (code response_cancelled), as one an engine abort ends.
"""

from __future__ import annotations

import secrets
from typing import Any, Protocol

from inferd.api.conversation.answer import AnswerFormat, Finish, Reasoning, Text, ToolCallArguments, ToolCallStart
from inferd.api.errors import APIError
from inferd.api.pipeline.shape import Reply
from inferd.api.responses.wire import OutputFunctionCall, OutputMessage, OutputReasoning, OutputText, ReasoningText
from inferd.api.streaming.sse import Named, Payload
from inferd.api.wire import dump
from inferd.engine.protocol import EngineOutput

OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall
# NOTE: the most events one token makes. An output's text makes a delta per piece the reasoning
# splitter and the tool-call parser find in it; a piece may close the open item (3 events) and
# open another (2); every item and every piece takes at least one token of text, but a token
# may end the reasoning and start the content. So 12 per token bounds a response's events (a
# background response's log: streaming/resume.py's event_bound).
EVENTS_PER_TOKEN = 12


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def finish_status(finish: str | None) -> str:
    return "incomplete" if finish in ("length", "timeout") else "completed"


class Responder(Protocol):
    """What the events need of their request's shape (create.py's ResponsesShape)."""

    answer: AnswerFormat  # how the model writes its answer (the shape's prepare set it)

    def namespace_of(self, name: str) -> str | None:
        """The namespace tool a called function came in (None for a plain function tool)."""
        ...

    def response(self, reply: Reply, output: list[OutputItem], status: str, usage: bool = True) -> dict[str, Any]:
        """The `response` object with this output and status."""
        ...

    def finished(self, reply: Reply, response: dict[str, Any], output: list[OutputItem]) -> None:
        """The response is complete (or incomplete): keep it, if it is to be kept."""
        ...


class ResponseEvents:
    """A streamed response's events (the module's docstring), and its output so far."""

    def __init__(self, shape: Responder, reply: Reply) -> None:
        self.shape, self.reply = shape, reply
        self.decoder = shape.answer.decoder(reply.tokenizer)
        self.sequence = 0
        self.output: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.status = "completed"
        self.started = False  # an engine output came: in progress, no longer queued
        self.failure: APIError | None = None  # what ended it early (an engine abort, a cancel)

    def _event(self, kind: str, **fields: Any) -> Named:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return Named(kind, payload)

    def snapshot(self, status: str) -> dict[str, Any]:
        """The response as it stands, with this status (a running background one's, for GET)."""
        return self.shape.response(self.reply, list(self.output), status, usage=False)

    def head(self) -> list[Payload]:
        snapshot = self.snapshot("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def render(self, prompt: int, out: EngineOutput) -> list[Payload]:
        self.started = True
        events: list[Payload] = []
        for part in self.decoder.feed(out.text, out.finished, out.finish_reason, out.stop_reason, out.new_token_ids):
            if isinstance(part, Reasoning):
                self._reasoning(events, part.text)
            elif isinstance(part, Text) and not part.filler:
                self._text(events, part.text)
            elif isinstance(part, ToolCallStart):
                self._open(events, OutputFunctionCall(id=item_id("fc"), call_id=part.id, name=part.name,
                                                      namespace=self.shape.namespace_of(part.name),
                                                      arguments="", status="in_progress"))
            elif isinstance(part, ToolCallArguments) and isinstance(self.open, OutputFunctionCall):
                self.open.arguments += part.fragment
                events.append(self._event("response.function_call_arguments.delta", item_id=self.open.id,
                                          output_index=len(self.output) - 1, delta=part.fragment))
            elif isinstance(part, Finish):
                self._close(events)
                self.status = finish_status(part.reason)
        return events

    def tail(self) -> list[Payload]:
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        response = self.shape.response(self.reply, self.output, self.status)
        self.shape.finished(self.reply, response, self.output)
        return [self._event(kind, response=response)]

    def error(self, error: APIError) -> Named:
        self.failure = error
        return self._event("error", code=error.code or error.type, message=error.message, param=error.param)

    def _text(self, events: list[Payload], text: str) -> None:
        if not isinstance(self.open, OutputMessage):
            self._open(events, OutputMessage(id=item_id("msg"), status="in_progress", content=[]))
            events.append(self._event("response.content_part.added", item_id=self.open.id,  # type: ignore[union-attr]
                                      output_index=len(self.output) - 1, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": []}))
            self.open.content.append(OutputText(text=""))  # type: ignore[union-attr]
        message = self.open
        assert isinstance(message, OutputMessage)
        message.content[0].text += text
        events.append(self._event("response.output_text.delta", item_id=message.id, output_index=len(self.output) - 1,
                                  content_index=0, delta=text, logprobs=[]))

    def _reasoning(self, events: list[Payload], text: str) -> None:
        if not isinstance(self.open, OutputReasoning):
            self._open(events, OutputReasoning(id=item_id("rs"), status="in_progress", content=[ReasoningText(text="")]))
        item = self.open
        assert isinstance(item, OutputReasoning)
        item.content[0].text += text
        events.append(self._event("response.reasoning_text.delta", item_id=item.id, output_index=len(self.output) - 1,
                                  content_index=0, delta=text))

    def _open(self, events: list[Payload], item: OutputItem) -> None:
        self._close(events)
        self.output.append(item)
        self.open = item
        events.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                  item=dump(item)))

    def _close(self, events: list[Payload]) -> None:
        item, index = self.open, len(self.output) - 1
        if item is None:
            return
        item.status = "completed"
        if isinstance(item, OutputMessage):
            part = dump(item.content[0])
            events.append(self._event("response.output_text.done", item_id=item.id, output_index=index,
                                      content_index=0, text=item.content[0].text, logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item.id, output_index=index,
                                      content_index=0, part=part))
        elif isinstance(item, OutputReasoning):
            events.append(self._event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                      content_index=0, text=item.content[0].text))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                      name=item.name, arguments=item.arguments))
        events.append(self._event("response.output_item.done", output_index=index, item=dump(item)))
        self.open = None
