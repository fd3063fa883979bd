"""POST /v1/chat/completions: messages rendered with the model's chat template, then one engine
request with n choices; its answer as a chat.completion or chat.completion.chunk events. The
shared path (api/pipeline/) does the rest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web

from inferd.api.body import read_json
from inferd.api.errors import bad_request
from inferd.api.admission.ask import Shaped, build_grammar
from inferd.api.conversation.answer import (AnswerFormat, Finish, Part, Reasoning, Text, ToolCallArguments,
                                            ToolCallStart, answer_format, decode_whole)
from inferd.api.conversation.reasoning_grammar import EFFORT_BUDGETS, after_reasoning, thinking
from inferd.api.conversation.render import call_arguments, render_prompt
from inferd.api.conversation.volatile import VOLATILE, VolatileBlocks
from inferd.api.openai.ask import to_ask
from inferd.api.openai.events import StreamEvents, with_usage
from inferd.api.openai.structured import request_grammar
from inferd.api.openai.logprobs import TokenTexts, chat_logprobs, token_texts
from inferd.api.openai.chat_wire import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    Tool,
    ToolCallOut,
)
from inferd.api.openai.wire import Usage
from inferd.api.pipeline.generate import generate
from inferd.api.pipeline.sessions import asked_session
from inferd.api.pipeline.shape import Events, Reply
from inferd.api.streaming.generation import ChoiceResult, Render
from inferd.api.streaming.sse import dumps
from inferd.engine.protocol import EngineOutput
from inferd.text.tokenizer import Tokenizer


def chat_prompt(tokenizer: Tokenizer, messages: Sequence[ChatMessage], tools: Sequence[Tool] | None,
                add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None,
                effort: str | None = None) -> list[int]:
    """The messages (and the tools offered, if any) as the model's prompt (conversation/render.py)."""
    specs = [t.model_dump(exclude_none=True) for t in tools or []]
    return render_prompt(tokenizer, [_template_message(m) for m in messages], specs, add_generation_prompt,
                         template_kwargs, effort=effort)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """One message as chat templates read it."""
    item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                            "content": message.text()}
    if message.name is not None:
        item["name"] = message.name
    if message.tool_call_id is not None:
        item["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if reasoning is not None:
        item["reasoning_content"] = reasoning  # (the name thinking templates read, Qwen3's among them)
    if message.tool_calls:
        # templates index arguments as a mapping (transformers' convention), OpenAI sends JSON text
        item["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": call_arguments(c.function.arguments)}} for c in message.tool_calls]
    return item


class ChatShape:
    """One chat request's prompt and answer (pipeline/shape.py's Shape)."""

    id_prefix = "chatcmpl"

    def __init__(self, body: ChatCompletionRequest) -> None:
        self.body = body
        self.answer = AnswerFormat(tools=body.calls_tools)  # how the model writes it (set by prepare)

    def prepare(self, tokenizer: Tokenizer, max_prompts: int) -> Shaped:
        body, effort = self.body, self.body.reasoning_effort
        prompt = chat_prompt(tokenizer, body.messages, body.tools if body.calls_tools else None,
                             template_kwargs=body.chat_template_kwargs, effort=effort)
        answer = self.answer = answer_format(tokenizer, prompt, body.calls_tools, functions=[
            t.model_dump(exclude_none=True) for t in body.tools or []])
        reasoning = answer.reasoning
        if effort is not None and not (answer.harmony or reasoning):
            raise bad_request("not supported: this model does not reason", param="reasoning_effort")
        # a thinking model's grammar holds the content only, and its reasoning may have a budget
        grammar = build_grammar(lambda: after_reasoning(request_grammar(body, tokenizer), tokenizer, reasoning))
        budget = body.thinking_token_budget
        if budget is None and effort is not None:
            budget = EFFORT_BUDGETS.get(effort)
        return Shaped([prompt], grammar, thinking(reasoning, budget), answer.stop_token_ids)

    def prompt_text(self, tokenizer: Tokenizer, prompts: list[list[int]]) -> str:
        return tokenizer.decode(prompts[0])

    def whole(self, reply: Reply, results: dict[int, ChoiceResult]) -> dict[str, Any]:
        token_text = token_texts(reply.tokenizer)
        choices = [self._choice(reply.tokenizer, token_text, index, result)
                   for index, result in sorted(results.items())]
        return ChatCompletionResponse(id=reply.id, created=reply.created, model=reply.model, choices=choices,
                                      usage=Usage(**reply.usage())).model_dump(mode="json")

    def _choice(self, tokenizer: Tokenizer, token_text: TokenTexts, index: int, result: ChoiceResult) -> ChatChoice:
        answer = decode_whole(tokenizer, self.answer, result.text, result.finish_reason, result.stop_reason,
                              result.token_ids)
        message = ChatResponseMessage(content=answer.text)
        if self.answer.tools:
            calls = [ToolCallOut.model_validate(call) for call in answer.calls]
            message = ChatResponseMessage(content=answer.text if answer.text.strip() or not calls else None,
                                          tool_calls=calls or None)
        if answer.reasoning:  # (a thinking model told not to think says nothing there: the fields stay absent)
            message.reasoning_content = message.reasoning = answer.reasoning
        return ChatChoice(
            index=index,
            message=message,
            logprobs=ChatLogprobs(**chat_logprobs(token_text, result.logprobs)) if self.body.logprobs else None,
            finish_reason=_finish(answer.finish.reason, bool(answer.calls)),  # type: ignore[arg-type]
        )

    def stream(self, reply: Reply) -> Events:
        body = self.body
        events = StreamEvents("chat.completion.chunk", reply.id, reply.created, reply.model)
        head = [events.event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}], reply.usage() if body.continuous_usage else None)
                for i in range(body.n)]

        def tail() -> list[dict[str, Any]]:
            return [events.event([], reply.usage())] if body.include_usage else []

        render = self._renderer(reply.tokenizer, events)
        return Events(head, with_usage(render, reply.usage) if body.continuous_usage else render, tail)

    def _renderer(self, tokenizer: Tokenizer, events: StreamEvents) -> Render:
        body, token_text = self.body, token_texts(tokenizer)
        decoders = {i: self.answer.decoder(tokenizer) for i in range(body.n)}

        def render(prompt: int, out: EngineOutput) -> dict[str, Any] | str:
            parts = decoders[out.index].feed(out.text, out.finished, out.finish_reason, out.stop_reason,
                                             out.new_token_ids)
            delta, finish = _delta(parts, self.answer.tools)
            if not body.logprobs:
                return events.token_event(out.index, f'"delta":{dumps(delta)}', finish)
            logprobs = chat_logprobs(token_text, out.logprobs or [])
            return events.event([{"index": out.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

        return render


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason: a choice that called tools and then stopped on its own ends "tool_calls"."""
    return "tool_calls" if called and reason == "stop" else reason


def _delta(parts: list[Part], tools: bool) -> tuple[dict[str, Any], str | None]:
    """One streamed output's parts as OpenAI's `delta`: reasoning, content, and tool-call fragments
    (the first with id and name, then argument pieces); and the choice's finish reason, if it ended."""
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
    texts = [p for p in parts if isinstance(p, Text)]
    content = "".join(p.text for p in texts)
    finish = next((p for p in parts if isinstance(p, Finish)), None)
    delta: dict[str, Any] = {}
    if reasoning:
        delta = {"reasoning_content": reasoning, "reasoning": reasoning}
    if not tools:
        if content or not (finish or reasoning):
            delta["content"] = content
        return delta, finish.reason if finish else None
    if content and not all(p.filler for p in texts):  # (not the newline between calls)
        delta["content"] = content
    calls: dict[int, dict[str, Any]] = {}
    for part in parts:
        if isinstance(part, ToolCallStart):
            calls[part.index] = {"index": part.index, "id": part.id, "type": "function",
                                 "function": {"name": part.name, "arguments": ""}}
        elif isinstance(part, ToolCallArguments):
            call = calls.setdefault(part.index, {"index": part.index, "function": {"arguments": ""}})
            call["function"]["arguments"] += part.fragment
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta, _finish(finish.reason, finish.called) if finish else None


def drop_volatile(volatile: VolatileBlocks, messages: Sequence[ChatMessage]) -> int:
    """Drop the volatile text of every message but a tool's (its text parts, or its whole text)
    before the prompt is rendered; how many blocks went."""
    dropped = 0
    for message in messages:
        if message.role != "tool":
            message.content, n = volatile.strip(message.content, lambda part: part.text)
            dropped += n
    return dropped


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    body = ChatCompletionRequest.model_validate(await read_json(request))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    volatile = request.app[VOLATILE]
    dropped = drop_volatile(volatile, body.messages)
    volatile.dropped += dropped
    ask = to_ask(body, max_tokens=max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                 fit_default=True, prompt_param="messages", session=asked_session(request, body.prompt_cache_key),
                 volatile_blocks=dropped)
    return await generate(request, ask, ChatShape(body))
