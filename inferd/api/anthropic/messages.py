"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's messages through the model's chat
template, one engine request, the answer as a `message` or its named stream events. The shared
path (api/pipeline/) does the rest.

Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens the prefix cache did
not serve, `cache_read_input_tokens` those it did (their sum is the prompt); inferd's
`prompt_cache` says why it did not serve more. cache_control asks for a session (cache.py).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from aiohttp import web

from inferd.api.admission.ask import Ask, Grammar, Sampling, SessionAsk, Shaped, build_grammar
from inferd.api.anthropic.cache import cache_controls, drop_volatile, session_of
from inferd.api.anthropic.wire import (
    CountTokensRequest,
    CountTokensResponse,
    Message,
    MessageResponse,
    MessagesRequest,
    Prompted,
    TextOut,
    ThinkingOut,
    ToolUseOut,
    MessageUsage,
)
from inferd.api.anthropic.errors import DIALECT
from inferd.api.body import read_json
from inferd.api.conversation.answer import (AnswerFormat, Decoder, Finish, Reasoning, Text, ToolCallArguments,
                                            ToolCallStart, answer_format, decode_whole)
from inferd.api.conversation.reasoning_grammar import after_reasoning, thinking
from inferd.api.conversation.render import render_prompt
from inferd.api.conversation.tool_policy import supported_tools
from inferd.api.conversation.tool_grammar import tools_grammar
from inferd.api.conversation.volatile import VOLATILE
from inferd.api.errors import bad_request
from inferd.api.pipeline.generate import generate
from inferd.api.pipeline.prompts import make_prompts
from inferd.api.pipeline.shape import Events, Reply
from inferd.api.routing.holds import hold_engine
from inferd.api.streaming.generation import ChoiceResult
from inferd.api.streaming.sse import Named, Payload
from inferd.api.wire import dump
from inferd.engine.protocol import EngineOutput
from inferd.text.tokenizer import Tokenizer


def template_messages(body: Prompted) -> list[dict[str, Any]]:
    """The conversation as chat templates read it (role, content, tool_calls, tool_call_id):
    tool_use blocks become the assistant's tool calls, tool_result blocks tool messages, thinking
    blocks the assistant's `reasoning_content` (where thinking templates read it)."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": body.system_text()})
    for message in body.messages:
        out += _turn(message)
    return out


def _turn(message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results, thoughts = [], [], [], []
    for block in message.content:
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "thinking":
            thoughts.append(block.thinking)
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}})
        elif block.type == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
    turn: list[dict[str, Any]] = list(results)  # a user turn answers the calls first, then speaks
    if texts or calls or not results:
        item: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
        if calls:
            item["tool_calls"] = calls
        if thoughts:
            item["reasoning_content"] = "".join(thoughts)
        turn.append(item)
    return turn


def template_kwargs(body: Prompted) -> dict[str, Any] | None:
    """Anthropic's `thinking` as the template's switch (Qwen3's enable_thinking); "adaptive" and
    "between_tools": the model's default."""
    if body.thinking is None or body.thinking.type not in ("enabled", "disabled"):
        return None
    return {"enable_thinking": body.thinking.type == "enabled"}


def reasoning_effort(body: Prompted) -> str | None:
    """`thinking` as a reasoning effort (harmony's, gpt-oss's system message): disabled is low, a
    budget under 2,048 tokens low, under 8,192 medium, else high; output_config's effort, if any,
    otherwise; None: the model's default."""
    thought = body.thinking
    if thought is not None and thought.type == "disabled":
        return "low"
    if thought is not None and thought.type == "enabled" and thought.budget_tokens is not None:
        budget = thought.budget_tokens
        return "low" if budget < 2048 else "medium" if budget < 8192 else "high"
    effort = (getattr(body, "output_config", None) or {}).get("effort")
    return effort if effort in ("low", "medium", "high") else None


def messages_prompt(tokenizer: Tokenizer, body: Prompted) -> list[int]:
    tools = [t.as_function() for t in body.tools or []] if body.calls_tools else []
    return render_prompt(tokenizer, template_messages(body), tools, template_kwargs=template_kwargs(body),
                         effort=reasoning_effort(body))


def calls_grammar(body: MessagesRequest, tokenizer: Tokenizer) -> Grammar | None:
    """tool_choice "any" or "tool": the answer is only tool calls (of that tool), grammar-forced;
    "auto" (or none given): text, and any call the model opens held to a valid call."""
    choice = body.tool_choice
    if not body.calls_tools:
        return None
    tools = [t.as_function() for t in body.tools or []]
    forced = choice if choice is not None and choice.type != "auto" else None
    try:
        return tools_grammar(tokenizer, tools, forced=forced is not None, name=forced.name if forced else None,
                             parallel=not (choice and choice.disable_parallel_tool_use), param="tool_choice")
    except ValueError as e:
        raise bad_request(str(e), param="tool_choice") from None


def to_ask(body: MessagesRequest, session: SessionAsk | None = None, volatile_blocks: int = 0) -> Ask:
    """What the body asks for, in the engine's terms; the door checks every limit of it."""
    sampling = Sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k or 0,
                        stop=tuple(body.stop_sequences or ()))
    return Ask(model=body.model, stream=body.stream, user=body.metadata.user_id if body.metadata else None,
               max_tokens=body.max_tokens, clamp_max_tokens=True, sampling=sampling, prompt_param="messages",
               session=session, volatile_blocks=volatile_blocks)


def tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def _usage(reply: Reply) -> dict[str, Any]:
    usage = reply.usage()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "prompt_cache": usage["prompt_cache"]}


def stop_reason(body: MessagesRequest, finish: str | None, stop: str | int | None,
                called: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for an engine finish. A timeout cut the answer
    short, as max_tokens does (a client asks to go on)."""
    if finish == "stop" and isinstance(stop, str) and stop in (body.stop_sequences or ()):
        return "stop_sequence", stop
    if finish in ("length", "timeout"):
        return "max_tokens", None
    return ("tool_use" if called else "end_turn"), None


class MessagesShape:
    """One messages request's prompt and answer (pipeline/shape.py's Shape)."""

    id_prefix = "msg"

    def __init__(self, body: MessagesRequest) -> None:
        self.body = body
        self.answer = AnswerFormat(tools=body.calls_tools, call_id=tool_use_id)  # (set by prepare)

    def prepare(self, tokenizer: Tokenizer, max_prompts: int) -> Shaped:
        """The prompt; a thinking model's tool-call grammar holds the content only, and
        `thinking.budget_tokens` is its budget."""
        body = self.body
        prompt = messages_prompt(tokenizer, body)
        answer = self.answer = answer_format(tokenizer, prompt, body.calls_tools, tool_use_id,
                                             [t.as_function() for t in body.tools or []])
        reasoning = answer.reasoning
        grammar = build_grammar(lambda: after_reasoning(calls_grammar(body, tokenizer), tokenizer, reasoning))
        budget = body.thinking.budget_tokens if body.thinking is not None and body.thinking.type == "enabled" else None
        return Shaped([prompt], grammar, thinking(reasoning, budget), answer.stop_token_ids)

    def prompt_text(self, tokenizer: Tokenizer, prompts: list[list[int]]) -> str:
        return tokenizer.decode(prompts[0])

    def whole(self, reply: Reply, results: dict[int, ChoiceResult]) -> dict[str, Any]:
        result = results[0]
        answer = decode_whole(reply.tokenizer, self.answer, result.text, result.finish_reason, result.stop_reason,
                              result.token_ids)
        content: list[ThinkingOut | TextOut | ToolUseOut] = []
        if answer.reasoning:
            content.append(ThinkingOut(thinking=answer.reasoning))
        if answer.text.strip() or not answer.calls:
            content.append(TextOut(text=answer.text))
        content += [ToolUseOut(id=c["id"], name=c["function"]["name"], input=_arguments(c)) for c in answer.calls]
        reason, sequence = stop_reason(self.body, result.finish_reason, result.stop_reason, bool(answer.calls))
        return dump(MessageResponse(id=reply.id, model=reply.model, content=content, stop_reason=reason,  # type: ignore[arg-type]
                                    stop_sequence=sequence, usage=MessageUsage(**_usage(reply))))

    def stream(self, reply: Reply) -> Events:
        start = {"type": "message_start", "message": {
            "id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": _usage(reply)}}
        blocks = StreamBlocks(self.body, reply, self.answer.decoder(reply.tokenizer))
        return Events([Named("message_start", start), Named("ping", {"type": "ping"})], blocks.render, blocks.tail,
                      DIALECT)


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed call's arguments as the object Anthropic's `input` is (a call whose arguments are not one gets {})."""
    try:
        value = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class StreamBlocks:
    """The content blocks of one streamed answer, as Anthropic's events: a thinking block while a
    thinking model reasons (`thinking_delta` pieces), a text block while the model writes text, a
    tool_use block per call (its input as `input_json_delta` pieces), each opened and stopped in
    turn; then `message_delta` (stop reason, usage) and `message_stop`."""

    def __init__(self, body: MessagesRequest, reply: Reply, decoder: Decoder) -> None:
        self.body, self.reply, self.decoder = body, reply, decoder
        self.index = -1  # the open block's, -1 before the first
        self.open: str | None = None  # its type
        self.stop: tuple[str, str | None] = ("end_turn", None)

    def render(self, prompt: int, out: EngineOutput) -> list[Payload]:
        events: list[Payload] = []
        for part in self.decoder.feed(out.text, out.finished, out.finish_reason, out.stop_reason, out.new_token_ids):
            if isinstance(part, Reasoning):
                self._thinking(events, part.text)
            elif isinstance(part, Text) and not part.filler:
                self._text(events, part.text)
            elif isinstance(part, ToolCallStart):
                self._open(events, "tool_use", {"type": "tool_use", "id": part.id, "name": part.name, "input": {}})
            elif isinstance(part, ToolCallArguments):
                events.append(self._delta({"type": "input_json_delta", "partial_json": part.fragment}))
            elif isinstance(part, Finish):
                self._close(events)
                self.stop = stop_reason(self.body, part.reason, part.stop, part.called)
        return events

    def tail(self) -> list[Payload]:
        reason, sequence = self.stop
        return [Named("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                            "stop_sequence": sequence},
                                        "usage": _usage(self.reply)}),
                Named("message_stop", {"type": "message_stop"})]

    def _thinking(self, events: list[Payload], text: str) -> None:
        if self.open != "thinking":
            self._open(events, "thinking", {"type": "thinking", "thinking": "", "signature": ""})
        events.append(self._delta({"type": "thinking_delta", "thinking": text}))

    def _text(self, events: list[Payload], text: str) -> None:
        if self.open != "text":
            self._open(events, "text", {"type": "text", "text": ""})
        events.append(self._delta({"type": "text_delta", "text": text}))

    def _open(self, events: list[Payload], kind: str, block: dict[str, Any]) -> None:
        self._close(events)
        self.index += 1
        self.open = kind
        events.append(Named("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": block}))

    def _close(self, events: list[Payload]) -> None:
        if self.open is not None:
            events.append(Named("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.open = None

    def _delta(self, delta: dict[str, Any]) -> Named:
        return Named("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


def _custom_tools_only(request: web.Request, body: Prompted) -> None:
    if body.tools:
        body.tools = supported_tools(request, body.tools, lambda tool: tool.type, lambda kind: kind in (None, "custom"))


async def create_message(request: web.Request) -> web.StreamResponse:
    body = MessagesRequest.model_validate(await read_json(request))
    controls = cache_controls(body)  # (before volatile blocks go: theirs ask too)
    _custom_tools_only(request, body)
    volatile = request.app[VOLATILE]
    dropped = drop_volatile(volatile, body)
    volatile.dropped += dropped
    session = session_of(request, body, controls, body.metadata.user_id if body.metadata else None)
    return await generate(request, to_ask(body, session, dropped), MessagesShape(body))


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's size as /v1/messages would make it (its usage's input tokens, before the
    cache's share); 404 for a model that is not served."""
    body = CountTokensRequest.model_validate(await read_json(request))
    _custom_tools_only(request, body)
    drop_volatile(request.app[VOLATILE], body)  # (as /v1/messages would; not counted: nothing is generated)
    engine = await hold_engine(request, body.model)  # (loaded first if need be; held until this returns)
    [tokens] = await make_prompts(request, engine.tokenizer, engine.limits.max_model_len,
                                  lambda tokenizer: [messages_prompt(tokenizer, body)])
    return web.json_response(dump(CountTokensResponse(input_tokens=len(tokens))))
