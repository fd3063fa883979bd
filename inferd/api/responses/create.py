"""POST /v1/responses: the input items through the model's chat template, after the stored
conversation they continue (`previous_response_id`), one engine request, the answer as a
`response` or its event sequence (events.py). The shared path (api/pipeline/) does the rest.

With `store` (responses.store_by_default when it is left out) the response and its conversation
are kept in the caller's store (stored.py); a `background` one is kept from its start and
generates on after the request is answered. Usage counts every prompt token in `input_tokens`,
the prefix cache's share in `input_tokens_details.cached_tokens` (most of a continued
conversation: it is the same token prefix as the turn before).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from inferd.api.admission.ask import Ask, Grammar, Sampling, SessionAsk, Shaped, build_grammar
from inferd.api.body import read_json
from inferd.api.conversation.answer import AnswerFormat, answer_format, decode_whole
from inferd.api.conversation.reasoning_grammar import EFFORT_BUDGETS, after_reasoning, thinking
from inferd.api.conversation.render import call_arguments, render_prompt
from inferd.api.conversation.tool_policy import supported_tools
from inferd.api.conversation.tool_grammar import tools_grammar
from inferd.api.conversation.volatile import VOLATILE, VolatileBlocks
from inferd.api.errors import bad_request
from inferd.api.pipeline.generate import generate
from inferd.api.pipeline.sessions import asked_session
from inferd.api.pipeline.shape import Events, Reply
from inferd.api.responses.events import EVENTS_PER_TOKEN, OutputItem, ResponseEvents, finish_status, item_id
from inferd.api.responses.stored import RESPONSE_STORE, Keeper, add_stored_endpoints, not_found, store_full
from inferd.api.responses.wire import (
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    Response,
    TOOL_TYPES,
    ResponsesRequest,
    ResponseUsage,
)
from inferd.api.state import SETTINGS
from inferd.api.streaming.generation import ChoiceResult
from inferd.api.streaming.resume import EventLog, caller_of
from inferd.api.streaming.sse import Dialect
from inferd.api.wire import dump
from inferd.engine.structured.grammar import GrammarError, json_object_grammar, json_schema_grammar
from inferd.text.tokenizer import Tokenizer


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The input as chat templates read it: messages (developer as system), function calls as
    the assistant's tool calls, their outputs as tool messages; reasoning items are left out."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict[str, Any]] = []
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


def template_messages(body: ResponsesRequest, history: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """What the chat template renders: `instructions` as the system turn (this request's: a
    previous response's are not carried over, as OpenAI's API does), the stored conversation
    continued, then the input."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return [*system, *history, *input_messages(body)]


def output_messages(output: Sequence[OutputItem]) -> list[dict[str, Any]]:
    """The output as the assistant's turn of the conversation a continuation renders (its
    reasoning where thinking templates read it)."""
    text = "".join(part.text for item in output if isinstance(item, OutputMessage) for part in item.content)
    reasoning = "".join(part.text for item in output if isinstance(item, OutputReasoning) for part in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                    "arguments": call_arguments(item.arguments)}}
             for item in output if isinstance(item, OutputFunctionCall)]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {}),
             **({"reasoning_content": reasoning} if reasoning else {})}]


def calls_tools(body: ResponsesRequest) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


def namespace_of(body: ResponsesRequest, name: str) -> str | None:
    """The namespace tool a called function came in (None for a plain function tool)."""
    return next((space for space, tool in body.namespaced_tools() if tool.name == name), None)


def grammar(body: ResponsesRequest, tokenizer: Tokenizer) -> Grammar | None:
    """tool_choice "required" or a named function: only calls; "auto": text, and well-formed
    calls; text.format json_schema / json_object: that JSON. Tools and a format cannot hold at once."""
    fmt = body.text.format if body.text else None
    tools = [t.as_function() for t in body.function_tools()]
    if calls_tools(body) and fmt is not None and fmt.type != "text":
        raise bad_request('text.format cannot be combined with tools; set tool_choice to "none" or leave '
                          "text.format out", param="text.format")
    try:
        if calls_tools(body):
            name = None if isinstance(body.tool_choice, str) else body.tool_choice.name
            return tools_grammar(tokenizer, tools, forced=body.tool_choice != "auto", name=name,
                                 parallel=body.parallel_tool_calls, param="tool_choice")
        if fmt is not None and fmt.type == "json_object":
            return Grammar(json_object_grammar(), kind="json_object", param="text.format")
        if fmt is not None and fmt.type == "json_schema":
            return Grammar(json_schema_grammar(fmt.schema_, strict=bool(fmt.strict)), kind="json_schema",  # type: ignore[union-attr]
                           param="text.format")
    except (ValueError, GrammarError) as e:
        raise bad_request(f"cannot be compiled: {e}", param="tool_choice" if calls_tools(body) else "text.format",
                          code="invalid_grammar") from None
    return None


def to_ask(body: ResponsesRequest, session: SessionAsk | None = None, volatile_blocks: int = 0) -> Ask:
    """What the body asks for, in the engine's terms; the door checks every limit of it."""
    # (a background response's events are produced, and kept, even when its client is not streamed them)
    return Ask(model=body.model, stream=body.stream or body.background, user=body.user, max_tokens=body.max_output_tokens,
               fit_default=True, sampling=Sampling(temperature=body.temperature, top_p=body.top_p),
               prompt_param="input", session=session, volatile_blocks=volatile_blocks)


def drop_volatile(volatile: VolatileBlocks, body: ResponsesRequest) -> int:
    """Drop the volatile text of `instructions` and of the input's messages (their text parts, or
    their whole text) before the prompt is rendered; how many blocks went."""
    dropped = 0
    if body.instructions is not None and volatile.matches(body.instructions):
        body.instructions, dropped = None, 1
    if isinstance(body.input, str):
        body.input, n = volatile.strip(body.input, lambda part: part.text)
        return dropped + n
    for item in body.input:
        if isinstance(item, MessageItem):
            item.content, n = volatile.strip(item.content, lambda part: part.text)
            dropped += n
    return dropped


def _usage(reply: Reply) -> ResponseUsage:
    usage = reply.usage()
    return ResponseUsage(input_tokens=usage["prompt_tokens"], output_tokens=usage["completion_tokens"],
                         total_tokens=usage["total_tokens"], prompt_cache=usage["prompt_cache"],
                         input_tokens_details=InputTokensDetails(cached_tokens=usage["prompt_tokens_details"]["cached_tokens"]))


class ResponsesShape:
    """One Responses request's prompt and answer (pipeline/shape.py's Shape); `history`: the
    stored conversation it continues; `keeper`: where it is kept, if it is."""

    id_prefix = "resp"

    def __init__(self, body: ResponsesRequest, history: Sequence[dict[str, Any]] = (),
                 keeper: Keeper | None = None) -> None:
        self.body = body
        self.history = history
        self.keeper = keeper
        self.answer = AnswerFormat(tools=calls_tools(body))  # how the model writes it (set by prepare)

    def namespace_of(self, name: str) -> str | None:
        return namespace_of(self.body, name)

    def prepare(self, tokenizer: Tokenizer, max_prompts: int) -> Shaped:
        """The prompt; a thinking model's grammar holds the content only, and `reasoning.effort`
        is its budget (EFFORT_BUDGETS)."""
        body = self.body
        tools = [t.as_function() for t in body.function_tools()] if calls_tools(body) else []
        effort = body.reasoning.effort if body.reasoning else None
        kwargs = {"enable_thinking": False} if effort == "none" else None
        messages = template_messages(body, self.history)
        prompt = render_prompt(tokenizer, messages, tools, template_kwargs=kwargs, param="input", effort=effort)
        answer = self.answer = answer_format(tokenizer, prompt, calls_tools(body),
                                             functions=[t.as_function() for t in body.function_tools()])
        reasoning = answer.reasoning
        held = build_grammar(lambda: after_reasoning(grammar(body, tokenizer), tokenizer, reasoning))
        budget = EFFORT_BUDGETS.get(effort) if effort is not None else None
        return Shaped([prompt], held, thinking(reasoning, budget), answer.stop_token_ids)

    def prompt_text(self, tokenizer: Tokenizer, prompts: list[list[int]]) -> str:
        return tokenizer.decode(prompts[0])

    def response(self, reply: Reply, output: list[OutputItem], status: str,
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
            reasoning=body.reasoning.model_dump() if body.reasoning else None,
            previous_response_id=body.previous_response_id, store=self.keeper is not None,
            background=body.background))

    def conversation(self, output: Sequence[OutputItem]) -> list[dict[str, Any]]:
        """The conversation this response ends: what a continuation of it renders before its input."""
        return [*self.history, *input_messages(self.body), *output_messages(output)]

    def finished(self, reply: Reply, response: dict[str, Any], output: list[OutputItem]) -> None:
        if self.keeper is not None:
            self.keeper.finished(reply.id, response, self.conversation(output))

    def whole(self, reply: Reply, results: dict[int, ChoiceResult]) -> dict[str, Any]:
        result = results[0]
        output: list[OutputItem] = []
        answer = decode_whole(reply.tokenizer, self.answer, result.text, result.finish_reason, result.stop_reason,
                              result.token_ids)
        if answer.reasoning:
            output.append(OutputReasoning(id=item_id("rs"), content=[ReasoningText(text=answer.reasoning)]))
        calls = answer.calls
        if answer.text.strip() or not calls:
            output.append(OutputMessage(id=item_id("msg"), content=[OutputText(text=answer.text)]))
        output += [OutputFunctionCall(id=item_id("fc"), call_id=c["id"], name=c["function"]["name"],
                                      namespace=namespace_of(self.body, c["function"]["name"]),
                                      arguments=c["function"]["arguments"]) for c in calls]
        response = self.response(reply, output, finish_status(result.finish_reason))
        self.finished(reply, response, output)
        return response

    def stream(self, reply: Reply) -> Events:
        events = ResponseEvents(self, reply)
        return Events(events.head(), events.render, events.tail, Dialect(events.error, end=""),
                      self._background(events) if self.body.background else None, EVENTS_PER_TOKEN)

    def _background(self, events: ResponseEvents) -> Callable[[EventLog], Awaitable[web.StreamResponse]]:
        """Where a background response's log goes: its caller's store, from the start."""
        keeper, follow = self.keeper, self.body.stream
        assert keeper is not None  # (create_response: a background response is always kept)
        return lambda log: keeper.background(log, events, follow, lambda: self.conversation(events.output))


async def create_response(request: web.Request) -> web.StreamResponse:
    body = ResponsesRequest.model_validate(await read_json(request))
    if body.tools:
        body.tools = supported_tools(request, body.tools, lambda tool: tool.get("type"), lambda kind: kind in TOOL_TYPES)
    history = _history(request, body)
    volatile = request.app[VOLATILE]
    dropped = drop_volatile(volatile, body)
    volatile.dropped += dropped
    shape = ResponsesShape(body, history, _keeper(request, body))
    return await generate(request, to_ask(body, asked_session(request, body.prompt_cache_key), dropped), shape)


def _history(request: web.Request, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation `previous_response_id` ends, from the caller's store (404 for another's)."""
    if body.previous_response_id is None:
        return []
    previous = request.app[RESPONSE_STORE].get(caller_of(request), body.previous_response_id)
    if previous is None:
        raise not_found(body.previous_response_id, param="previous_response_id")
    if previous.response is None:
        raise bad_request(f"response {previous.id!r} is still in progress: continue it once it has ended",
                          param="previous_response_id", code="response_in_progress")
    return previous.conversation


def _keeper(request: web.Request, body: ResponsesRequest) -> Keeper | None:
    """Where the response is kept (None: nowhere). A background one always is; one more than the
    caller's store may hold running is a 429."""
    if body.background and body.store is False:
        raise bad_request("a background response is kept until it is retrieved: send store: true (or leave it "
                          "out)", param="background")
    keep = body.store if body.store is not None else body.background or request.app[SETTINGS].responses.store_by_default
    if not keep:
        return None
    store, owner = request.app[RESPONSE_STORE], caller_of(request)
    if body.background and not store.has_room(owner):  # (before any charge)
        raise store_full(store)
    return Keeper(request, store, owner)


def add_responses_endpoints(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    add_stored_endpoints(app)

