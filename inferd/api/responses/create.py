"""POST /v1/responses (stateless, for now): the input items through the model's chat template,
one engine request, the answer as a `response` or its event sequence. The shared path
(api/pipeline/) does the rest.

Nothing is stored yet: `store` is accepted (the reply says `store: false`), `previous_response_id`
is a 404 naming the response, `background` a 400. Usage counts every prompt token in
`input_tokens`, the prefix cache's share in `input_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import secrets
from typing import Any

from aiohttp import web

from inferd.api.admission.ask import Ask, Grammar, Sampling
from inferd.api.body import read_json
from inferd.api.conversation.render import call_arguments, render_prompt
from inferd.api.conversation.tool_policy import supported_tools
from inferd.api.conversation.tools import Arguments, CallStart, Content, ToolCallParser, tool_call_grammar
from inferd.api.errors import APIError, bad_request
from inferd.api.pipeline.generate import generate
from inferd.api.pipeline.shape import Events, Reply
from inferd.api.responses.wire import (
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    Response,
    TOOL_TYPES,
    ResponsesRequest,
    ResponseUsage,
)
from inferd.api.streaming.generation import ChoiceResult
from inferd.api.streaming.sse import Dialect, Named, Payload
from inferd.api.wire import dump
from inferd.engine.protocol import EngineOutput
from inferd.engine.structured.grammar import GrammarError, json_object_grammar, json_schema_grammar
from inferd.model.tokenizer import Tokenizer


def template_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The input as chat templates read it: `instructions` as the system turn, messages
    (developer as system), function calls as the assistant's tool calls, their outputs as tool
    messages; reasoning items are left out."""
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, MessageItem):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                          "arguments": call_arguments(item.arguments)}}
            if not (out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]):
                out.append({"role": "assistant", "content": "", "tool_calls": []})
            out[-1]["tool_calls"].append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def calls_tools(body: ResponsesRequest) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


def namespace_of(body: ResponsesRequest, name: str) -> str | None:
    """The namespace tool a called function came in (None for a plain function tool)."""
    return next((space for space, tool in body.namespaced_tools() if tool.name == name), None)


def grammar(body: ResponsesRequest) -> Grammar | None:
    """tool_choice "required" or a named function: only calls; text.format json_schema /
    json_object: that JSON. The two cannot hold at once."""
    fmt = body.text.format if body.text else None
    tools = [t.as_function() for t in body.function_tools()]
    if calls_tools(body) and fmt is not None and fmt.type != "text":
        raise bad_request('text.format cannot be combined with tools; set tool_choice to "none" or leave '
                          "text.format out", param="text.format")
    try:
        if calls_tools(body) and body.tool_choice != "auto":
            name = None if body.tool_choice == "required" else body.tool_choice.name  # type: ignore[union-attr]
            return Grammar(tool_call_grammar(tools, name, body.parallel_tool_calls), kind="tools", param="tool_choice")
        if fmt is not None and fmt.type == "json_object":
            return Grammar(json_object_grammar(), kind="json_object", param="text.format")
        if fmt is not None and fmt.type == "json_schema":
            return Grammar(json_schema_grammar(fmt.schema_, strict=bool(fmt.strict)), kind="json_schema",  # type: ignore[union-attr]
                           param="text.format")
    except (ValueError, GrammarError) as e:
        raise bad_request(f"cannot be compiled: {e}", param="tool_choice" if calls_tools(body) else "text.format",
                          code="invalid_grammar") from None
    return None


def to_ask(body: ResponsesRequest) -> Ask:
    return Ask(model=body.model, stream=body.stream, user=body.user, max_tokens=body.max_output_tokens,
               fit_default=True, sampling=Sampling(temperature=body.temperature, top_p=body.top_p),
               prompt_param="input", grammar=lambda: grammar(body))


def _usage(reply: Reply) -> ResponseUsage:
    usage = reply.usage()
    return ResponseUsage(input_tokens=usage["prompt_tokens"], output_tokens=usage["completion_tokens"],
                         total_tokens=usage["total_tokens"],
                         input_tokens_details=InputTokensDetails(cached_tokens=usage["prompt_tokens_details"]["cached_tokens"]))


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponsesShape:
    """One Responses request's prompt and answer (pipeline/shape.py's Shape)."""

    id_prefix = "resp"

    def __init__(self, body: ResponsesRequest) -> None:
        self.body = body

    def prompts(self, tokenizer: Tokenizer, max_prompts: int) -> list[list[int]]:
        body = self.body
        tools = [t.as_function() for t in body.function_tools()] if calls_tools(body) else []
        effort = body.reasoning.effort if body.reasoning else None
        kwargs = {"enable_thinking": False} if effort == "none" else None
        return [render_prompt(tokenizer, template_messages(body), tools, template_kwargs=kwargs, param="input")]

    def prompt_text(self, tokenizer: Tokenizer, prompts: list[list[int]]) -> str:
        return tokenizer.decode(prompts[0])

    def response(self, reply: Reply, output: list[OutputMessage | OutputFunctionCall], status: str,
                 usage: bool = True) -> dict[str, Any]:
        body = self.body
        incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return dump(Response(
            id=reply.id, created_at=reply.created, status=status, model=reply.model, output=output,  # type: ignore[arg-type]
            usage=_usage(reply) if usage else None, incomplete_details=incomplete, instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, parallel_tool_calls=body.parallel_tool_calls,
            temperature=body.temperature, top_p=body.top_p,
            tool_choice=body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump(),
            tools=body.tools or [], metadata=body.metadata or {}, user=body.user,
            text={"format": body.text.format.model_dump(by_alias=True)} if body.text and body.text.format
            else {"format": {"type": "text"}},
            reasoning=body.reasoning.model_dump() if body.reasoning else None))

    def whole(self, reply: Reply, results: dict[int, ChoiceResult]) -> dict[str, Any]:
        result = results[0]
        output: list[OutputMessage | OutputFunctionCall] = []
        text = result.text
        calls: list[dict[str, Any]] = []
        if calls_tools(self.body):
            parser = ToolCallParser()
            events = parser.feed(result.text) + parser.finish()
            text = "".join(e.text for e in events if isinstance(e, Content))
            calls = parser.calls
        if text.strip() or not calls:
            output.append(OutputMessage(id=_item_id("msg"), content=[OutputText(text=text)]))
        output += [OutputFunctionCall(id=_item_id("fc"), call_id=c["id"], name=c["function"]["name"],
                                      namespace=namespace_of(self.body, c["function"]["name"]),
                                      arguments=c["function"]["arguments"]) for c in calls]
        return self.response(reply, output, _status(result.finish_reason))

    def stream(self, reply: Reply) -> Events:
        events = ResponseEvents(self, reply)
        return Events(events.head(), events.render, events.tail, Dialect(events.error, end=""))


def _status(finish: str | None) -> str:
    return "incomplete" if finish in ("length", "timeout") else "completed"


class ResponseEvents:
    """A streamed response's events, each numbered by `sequence_number`: created, in_progress;
    per output item added, its text or arguments in deltas, done; then completed (or incomplete)
    with the whole response."""

    def __init__(self, shape: ResponsesShape, reply: Reply) -> None:
        self.shape, self.reply = shape, reply
        self.parser = ToolCallParser() if calls_tools(shape.body) else None
        self.sequence = 0
        self.output: list[OutputMessage | OutputFunctionCall] = []
        self.open: OutputMessage | OutputFunctionCall | None = None
        self.status = "completed"

    def _event(self, kind: str, **fields: Any) -> Named:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return Named(kind, payload)

    def head(self) -> list[Payload]:
        snapshot = self.shape.response(self.reply, [], "in_progress", usage=False)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def render(self, prompt: int, out: EngineOutput) -> list[Payload]:
        events: list[Payload] = []
        found = [Content(out.text)] if self.parser is None else (
            self.parser.feed(out.text) + (self.parser.finish() if out.finished else []))
        for event in found:
            if isinstance(event, Content) and event.text:
                if not (self.parser is not None and self.parser.calls_started and not event.text.strip()):
                    self._text(events, event.text)
            elif isinstance(event, CallStart):
                self._open(events, OutputFunctionCall(id=_item_id("fc"), call_id=event.id, name=event.name,
                                                      namespace=namespace_of(self.shape.body, event.name),
                                                      arguments="", status="in_progress"))
            elif isinstance(event, Arguments) and isinstance(self.open, OutputFunctionCall):
                self.open.arguments += event.fragment
                events.append(self._event("response.function_call_arguments.delta", item_id=self.open.id,
                                          output_index=len(self.output) - 1, delta=event.fragment))
        if out.finished:
            self._close(events)
            self.status = _status(out.finish_reason)
        return events

    def tail(self) -> list[Payload]:
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return [self._event(kind, response=self.shape.response(self.reply, self.output, self.status))]

    def error(self, error: APIError) -> Named:
        return self._event("error", code=error.code or error.type, message=error.message, param=error.param)

    def _text(self, events: list[Payload], text: str) -> None:
        if not isinstance(self.open, OutputMessage):
            self._open(events, OutputMessage(id=_item_id("msg"), status="in_progress", content=[]))
            events.append(self._event("response.content_part.added", item_id=self.open.id,  # type: ignore[union-attr]
                                      output_index=len(self.output) - 1, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": []}))
            self.open.content.append(OutputText(text=""))  # type: ignore[union-attr]
        message = self.open
        assert isinstance(message, OutputMessage)
        message.content[0].text += text
        events.append(self._event("response.output_text.delta", item_id=message.id, output_index=len(self.output) - 1,
                                  content_index=0, delta=text, logprobs=[]))

    def _open(self, events: list[Payload], item: OutputMessage | OutputFunctionCall) -> None:
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
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                      name=item.name, arguments=item.arguments))
        events.append(self._event("response.output_item.done", output_index=index, item=dump(item)))
        self.open = None


async def create_response(request: web.Request) -> web.StreamResponse:
    body = ResponsesRequest.model_validate(await read_json(request))
    if body.tools:
        body.tools = supported_tools(request, body.tools, lambda tool: tool.get("type"), lambda kind: kind in TOOL_TYPES)
    if body.previous_response_id is not None:
        raise APIError(404, f"no stored response {body.previous_response_id!r}: this server keeps no responses "
                       "yet (send the whole conversation as input)", param="previous_response_id",
                       code="response_not_found")
    return await generate(request, to_ask(body), ResponsesShape(body))


def add_responses_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)

