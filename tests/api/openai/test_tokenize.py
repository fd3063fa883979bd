"""POST /tokenize and /detokenize on the real default model: round trips, counts that equal what
the generation endpoints report as usage.prompt_tokens, and their errors."""

from __future__ import annotations

import pytest
from apiserver import MODEL, Server, assert_error, serve

from inferd.api.gateway.keys import load_api_keys
from inferd.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

TEXT = "Hello, world! The capital of France is Paris. ünïcödé 東京 🙂"
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": [{"type": "text", "text": "And of "}, {"type": "text", "text": "Japan?"}]},
]


async def tokenize(server: Server, body: dict) -> dict:
    status, reply = await server.post("/tokenize", body)
    assert status == 200, reply
    assert set(reply) == {"count", "max_model_len", "tokens"}
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == server.engine.limits.max_model_len
    return reply


async def detokenize(server: Server, tokens: list[int]) -> str:
    status, reply = await server.post("/detokenize", {"model": MODEL, "tokens": tokens})
    assert status == 200, reply
    assert set(reply) == {"prompt"}
    return reply["prompt"]


async def test_prompt_round_trip(server: Server) -> None:
    reply = await tokenize(server, {"model": MODEL, "prompt": TEXT})
    assert reply["tokens"] == server.engine.tokenizer.encode(TEXT)
    assert await detokenize(server, reply["tokens"]) == TEXT
    assert await detokenize(server, []) == ""
    # the model is optional; add_special_tokens=false leaves out what the tokenizer adds (no BOS here)
    assert (await tokenize(server, {"prompt": TEXT, "add_special_tokens": False}))["tokens"] == reply["tokens"]
    assert (await tokenize(server, {"prompt": ""}))["count"] == 0


async def test_count_equals_completions_prompt_tokens(server: Server) -> None:
    count = (await tokenize(server, {"prompt": TEXT}))["count"]
    status, reply = await server.post("/v1/completions", {"model": MODEL, "prompt": TEXT, "max_tokens": 1})
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens"] == count


@pytest.mark.parametrize("messages", [CONVERSATION[1:2], CONVERSATION], ids=["one", "four"])
async def test_chat_count_equals_chat_prompt_tokens(server: Server, messages: list[dict]) -> None:
    reply = await tokenize(server, {"model": MODEL, "messages": messages})
    status, chat = await server.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1})
    assert status == 200, chat
    assert chat["usage"]["prompt_tokens"] == reply["count"]
    # the template's special tokens come back as text: what the model sees
    text = await detokenize(server, reply["tokens"])
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?<|im_end|>" in text


async def test_chat_without_generation_prompt(server: Server) -> None:
    with_prompt = (await tokenize(server, {"messages": CONVERSATION}))["tokens"]
    without = (await tokenize(server, {"messages": CONVERSATION, "add_generation_prompt": False}))["tokens"]
    assert 0 < len(without) < len(with_prompt) and with_prompt[: len(without)] == without
    assert (await detokenize(server, without)).endswith("Japan?<|im_end|>\n")


async def test_wrong_model(server: Server) -> None:
    for path, body in [("/tokenize", {"prompt": "Hi"}), ("/tokenize", {"messages": CONVERSATION}),
                       ("/detokenize", {"tokens": [1]})]:
        status, reply = await server.post(path, {**body, "model": "gpt-4"})
        assert_error(status, reply, 404, param="model", code="model_not_found")


async def test_tokens_outside_the_vocabulary(server: Server) -> None:
    vocab = server.engine.tokenizer.vocab_size
    for tokens in ([vocab], [1, -1], [2**70]):
        status, reply = await server.post("/detokenize", {"tokens": tokens})
        assert_error(status, reply, 400, param="tokens")
        assert str(tokens[-1]) in reply["error"]["message"]
    assert await detokenize(server, [vocab - 1]) == server.engine.tokenizer.decode([vocab - 1])


async def test_invalid_bodies(server: Server) -> None:
    cases = [
        ("/tokenize", {"prompt": "Hi", "temperature": 0}, "temperature"),  # unknown fields are 400s
        ("/tokenize", {"messages": CONVERSATION, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"messages": CONVERSATION, "prompt": "Hi"}, "prompt"),
        ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"prompt": "Hi", "add_special_tokens": 1}, "add_special_tokens"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "Hi"}]}, "messages.0.role"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [1, "2"]}, "tokens.1"),
        ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ]
    for path, body, param in cases:
        status, reply = await server.post(path, body)
        assert_error(status, reply, 400, param=param)
    for path in ("/tokenize", "/detokenize"):
        async with server.session.post(path, data=b"[1, 2]") as r:
            assert_error(r.status, await r.json(), 400)


async def test_the_api_key_is_needed(llm: LLMEngine) -> None:
    key = "sk-tokenize"
    async with serve(llm, api_keys=load_api_keys([key], None, None)) as server:
        assert_error(*await server.post("/tokenize", {"prompt": "Hi"}), 401, code="invalid_api_key")
        assert_error(*await server.post("/detokenize", {"tokens": [1]}), 401, code="invalid_api_key")
        status, reply = await server.post("/tokenize", {"prompt": "Hi"}, headers={"Authorization": f"Bearer {key}"})
        assert status == 200 and reply["count"] == 1


async def test_openapi_lists_both(server: Server) -> None:
    status, doc = await server.get("/openapi.json")
    assert status == 200
    for path, model in [("/tokenize", "TokenizeResponse"), ("/detokenize", "DetokenizeResponse")]:
        responses = doc["paths"][path]["post"]["responses"]
        assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert {"400", "401", "404"} <= set(responses)
    schemas = doc["components"]["schemas"]
    assert schemas["TokenizeChatRequest"]["additionalProperties"] is False
    assert {"TokenizeCompletionRequest", "DetokenizeRequest", "TokenizeResponse"} <= set(schemas)
