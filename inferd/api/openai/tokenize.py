"""POST /tokenize, POST /detokenize and GET /tokenizer_info, in vLLM's shapes (llama-server has
the first two too):

    {"prompt": "Hi", "add_special_tokens": true}             -> {"count", "max_model_len", "tokens"}
    {"messages": [...], "add_generation_prompt": true}      -> the same, through the chat template
    {"tokens": [1, 2, 3]}                                    -> {"prompt": "..."}
    GET /tokenizer_info[?model=NAME]                         -> special tokens, chat template, max length

Messages become tokens exactly as /v1/chat/completions makes them (chat_prompt), so
`count` is that endpoint's usage.prompt_tokens. Nothing here reaches the engine loop: the
tokenizer runs on the event loop, as it does for the generation endpoints.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import Field

from inferd.api.body import read_json
from inferd.api.errors import bad_request
from inferd.api.conversation.volatile import VOLATILE
from inferd.api.openai.chat import chat_prompt, drop_volatile
from inferd.api.openai.chat_wire import ChatMessage, Tool
from inferd.api.pipeline.prompts import make_prompts
from inferd.api.routing.holds import hold_engine
from inferd.api.wire import RequestModel, ResponseModel, dump
from inferd.engine.async_engine import AsyncEngine
from inferd.text.tokenizer import Tokenizer


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None  # when given, the served model's name
    prompt: str
    add_special_tokens: bool = True  # BOS / EOS as the model's tokenizer adds them to a prompt


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True  # end with the assistant's header, as the chat endpoint does
    tools: list[Tool] | None = None  # offered to the model: their instructions are part of the prompt


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class TokenizerInfo(ResponseModel):
    """What a client tokenizing on its own side asks for (lm-evaluation-harness's remote tokenizer)."""

    tokenizer_class: str = "inferd"
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str  # special tokens included: the text the model sees


def parse_tokenize(data: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The request by its shape: `messages` makes it a chat one (so an error names the field at
    fault, not a union member)."""
    return (TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest).model_validate(data)


async def _engine(request: web.Request, model: str | None) -> AsyncEngine:
    """The engine of the model (or alias) named, else the first model's, held until the handler
    returns (loaded first if need be: routing/holds.py); 404 for an unknown one. A route's
    targets may tokenize differently: name a model."""
    return await hold_engine(request, model)


async def tokenize(request: web.Request) -> web.Response:
    body = parse_tokenize(await read_json(request))
    engine = await _engine(request, body.model)
    if isinstance(body, TokenizeChatRequest):  # (as the chat path renders them; not counted)
        drop_volatile(request.app[VOLATILE], body.messages)

    def count(tokenizer: Tokenizer) -> list[list[int]]:
        if isinstance(body, TokenizeChatRequest):
            return [chat_prompt(tokenizer, body.messages, body.tools, body.add_generation_prompt)]
        return [tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)]

    [tokens] = await make_prompts(request, engine.tokenizer, engine.limits.max_model_len, count)
    reply = TokenizeResponse(count=len(tokens), max_model_len=engine.limits.max_model_len, tokens=tokens)
    return web.json_response(dump(reply))


async def detokenize(request: web.Request) -> web.Response:
    body = DetokenizeRequest.model_validate(await read_json(request))
    tokenizer = (await _engine(request, body.model)).tokenizer
    vocab = tokenizer.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return web.json_response(dump(DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))))


async def tokenizer_info(request: web.Request) -> web.Response:
    engine = await _engine(request, request.query.get("model"))
    tok = engine.tokenizer
    pad = tok.pad_token_id

    def piece(token_id: int | None) -> str | None:
        return None if token_id is None else tok.decode([token_id], skip_special_tokens=False)

    info = TokenizerInfo(
        bos_token=tok.bos_token, eos_token=tok.eos_token, pad_token=piece(pad), bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=pad,
        chat_template=tok.chat_template, model_max_length=engine.limits.max_model_len, vocab_size=tok.vocab_size)
    return web.json_response(dump(info))
