"""POST /v1/chat/completions: messages rendered with the model's chat template, then one engine
request with n choices; its answer as a chat.completion or chat.completion.chunk events. The
shared path (api/pipeline/) does the rest."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from inferd.api.body import read_json
from inferd.api.conversation.reasoning import PromptReasoning, ReasoningSplitter, prompt_reasoning, split_output
from inferd.api.conversation.reasoning_grammar import after_reasoning, thinking
from inferd.api.conversation.render import call_arguments, render_prompt
from inferd.api.conversation.tool_formats import ToolParser, tool_parser
from inferd.api.conversation.tools import Arguments, CallStart, Content
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
from inferd.api.pipeline.shape import Events, Reply
from inferd.api.streaming.generation import ChoiceResult, Render
from inferd.api.streaming.sse import dumps
from inferd.engine.protocol import EngineOutput
from inferd.text.tokenizer import Tokenizer


def chat_prompt(tokenizer: Tokenizer, messages: Sequence[ChatMessage], tools: Sequence[Tool] | None,
                add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The messages (and the tools offered, if any) as the model's prompt (conversation/render.py)."""
    specs = [t.model_dump(exclude_none=True) for t in tools or []]
    return render_prompt(tokenizer, [_template_message(m) for m in messages], specs, add_generation_prompt,
                         template_kwargs)


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
        self.reasoning: PromptReasoning | None = None  # a thinking model's: its answers split into reasoning and content

    def prompts(self, tokenizer: Tokenizer, max_prompts: int) -> list[list[int]]:
        body = self.body
        prompt = chat_prompt(tokenizer, body.messages, body.tools if body.calls_tools else None,
                             template_kwargs=body.chat_template_kwargs)
        self.reasoning = prompt_reasoning(tokenizer, prompt)
        return [prompt]

    def prompt_text(self, tokenizer: Tokenizer, prompts: list[list[int]]) -> str:
        return tokenizer.decode(prompts[0])

    def whole(self, reply: Reply, results: dict[int, ChoiceResult]) -> dict[str, Any]:
        token_text = token_texts(reply.tokenizer)
        choices = [self._choice(reply.tokenizer, token_text, index, result)
                   for index, result in sorted(results.items())]
        return ChatCompletionResponse(id=reply.id, created=reply.created, model=reply.model, choices=choices,
                                      usage=Usage(**reply.usage())).model_dump(mode="json")

    def _choice(self, tokenizer: Tokenizer, token_text: TokenTexts, index: int, result: ChoiceResult) -> ChatChoice:
        body, text, reasoning = self.body, result.text, None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
        message, finish = ChatResponseMessage(content=text), result.finish_reason
        if body.calls_tools:
            parser = tool_parser(tokenizer)
            events = parser.feed(text) + parser.finish()
            content = "".join(e.text for e in events if isinstance(e, Content))
            calls = [ToolCallOut.model_validate(call) for call in parser.calls]
            message = ChatResponseMessage(content=content if content.strip() or not calls else None,
                                          tool_calls=calls or None)
            finish = _tool_finish(finish, bool(calls))
        if reasoning:  # (a thinking model told not to think says nothing there: the fields stay absent)
            message.reasoning_content = message.reasoning = reasoning
        return ChatChoice(
            index=index,
            message=message,
            logprobs=ChatLogprobs(**chat_logprobs(token_text, result.logprobs)) if body.logprobs else None,
            finish_reason=finish,  # type: ignore[arg-type]
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
        body, token_text, thinks = self.body, token_texts(tokenizer), self.reasoning
        parsers = {i: tool_parser(tokenizer) for i in range(body.n)} if body.calls_tools else None
        splitters = {i: thinks.splitter() for i in range(body.n)} if thinks is not None else None

        def render(prompt: int, out: EngineOutput) -> dict[str, Any] | str:
            reasoning = ""
            if splitters is not None:
                out, reasoning = _split_reasoning(splitters[out.index], out)
            delta: dict[str, Any] = {"content": out.text} if out.text or not (out.finished or reasoning) else {}
            finish = out.finish_reason
            if parsers is not None:
                delta, finish = _tool_delta(parsers[out.index], out)
            if reasoning:
                delta = {"reasoning_content": reasoning, "reasoning": reasoning, **delta}
            if not body.logprobs:
                return events.token_event(out.index, f'"delta":{dumps(delta)}', finish)
            logprobs = chat_logprobs(token_text, out.logprobs or [])
            return events.event([{"index": out.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

        return render


def _split_reasoning(splitter: ReasoningSplitter, out: EngineOutput) -> tuple[EngineOutput, str]:
    """One streamed output of a thinking model: the output with its content only, and its reasoning."""
    reasoning, content = split_output(splitter, out.text, out.finished)
    return dataclasses.replace(out, text=content), reasoning


def _tool_finish(finish: str | None, called: bool) -> str | None:
    """OpenAI's finish reason for a choice that called tools and then stopped on its own."""
    return "tool_calls" if called and finish == "stop" else finish


def _tool_delta(parser: ToolParser, out: EngineOutput) -> tuple[dict[str, Any], str | None]:
    """One streamed output of a choice offered tools: its content and its tool-call fragments
    (OpenAI's `delta.tool_calls`: the first with id and name, then argument pieces)."""
    found = parser.feed(out.text) + (parser.finish() if out.finished else [])
    content = "".join(e.text for e in found if isinstance(e, Content))
    calls: dict[int, dict[str, Any]] = {}
    for event in found:
        if isinstance(event, CallStart):
            calls[event.index] = {"index": event.index, "id": event.id, "type": "function",
                                  "function": {"name": event.name, "arguments": ""}}
        elif isinstance(event, Arguments):
            call = calls.setdefault(event.index, {"index": event.index, "function": {"arguments": ""}})
            call["function"]["arguments"] += event.fragment
    delta: dict[str, Any] = {}
    if content and not (parser.calls_started and not content.strip()):  # not the newline between calls
        delta["content"] = content
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta, _tool_finish(out.finish_reason, parser.calls_started > 0) if out.finished else None


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    body = ChatCompletionRequest.model_validate(await read_json(request))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    ask, shape = to_ask(body, max_tokens=max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                        fit_default=True, prompt_param="messages"), ChatShape(body)
    # a thinking model's grammar holds the content only, and its reasoning may have a budget
    # (both asked once the prompt is made: the shape knows how it reasons then)
    ask = dataclasses.replace(
        ask, grammar=lambda tokenizer: after_reasoning(request_grammar(body, tokenizer), tokenizer, shape.reasoning),
        thinking=lambda: thinking(shape.reasoning, body.thinking_token_budget))
    return await generate(request, ask, shape)
