"""Bad input gets a 4xx in OpenAI's error shape, naming the offending field; never a 500."""

from __future__ import annotations

import pytest
from apiserver import MODEL, Server, assert_error, serve

from inferd.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


# ------------------------------------------------------------------------- the request body


async def test_malformed_json(server: Server) -> None:
    async with server.session.post(COMPLETIONS, data=b'{"model": "smollm2", "prompt": ', headers={"Content-Type": "application/json"}) as r:
        body = await r.json()
    assert_error(r.status, body, 400)
    assert "JSON" in body["error"]["message"]


async def test_body_not_an_object(server: Server) -> None:
    assert_error(*await server.post(COMPLETIONS, [1, 2, 3]), 400)


async def test_nan_is_not_json(server: Server) -> None:
    async with server.session.post(CHAT, data=b'{"model": "smollm2", "messages": [], "temperature": NaN}') as r:
        assert_error(r.status, await r.json(), 400)


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        # wrong types
        (COMPLETIONS, {"max_tokens": "ten"}, "max_tokens"),
        (COMPLETIONS, {"max_tokens": True}, "max_tokens"),
        (COMPLETIONS, {"max_tokens": 1.5}, "max_tokens"),
        (COMPLETIONS, {"prompt": 42}, "prompt"),
        (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
        (COMPLETIONS, {"stream": "yes"}, "stream"),
        (CHAT, {"messages": "Hi"}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content"),
        (CHAT, {"stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),
        (CHAT, {"logprobs": 1}, "logprobs"),
        # out of range
        (COMPLETIONS, {"temperature": 3}, "temperature"),
        (COMPLETIONS, {"temperature": -0.5}, "temperature"),
        (COMPLETIONS, {"top_p": 0}, "top_p"),
        (COMPLETIONS, {"n": 0}, "n"),
        (COMPLETIONS, {"n": 9}, "n"),
        (CHAT, {"n": 100}, "n"),
        (COMPLETIONS, {"presence_penalty": 5}, "presence_penalty"),
        (CHAT, {"frequency_penalty": -2.5}, "frequency_penalty"),
        (COMPLETIONS, {"logprobs": 99}, "logprobs"),
        (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"top_k": -2}, "top_k"),
        (COMPLETIONS, {"min_p": 1.5}, "min_p"),
        (COMPLETIONS, {"seed": 2**70}, "seed"),
        (COMPLETIONS, {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (CHAT, {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=true
        (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
        # missing or unsupported
        (COMPLETIONS, {"model": None}, "model"),
        (COMPLETIONS, {"suffix": "end"}, "suffix"),
        (CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages.0.role"),
        (CHAT, {"messages": [{"content": "Hi"}]}, "messages.0.role"),
    ],
    ids=lambda v: v if isinstance(v, str) and not v.startswith("/") else None,
)
async def test_invalid_field(server: Server, path: str, change: dict, param: str) -> None:
    body = {**(PROMPT if path == COMPLETIONS else CHAT_BODY), **change}
    body = {k: v for k, v in body.items() if v is not None}
    status, error = await server.post(path, body)
    assert_error(status, error, 400, param=param)


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        (CHAT, {"frobnicate": 1}, "frobnicate"),
        (COMPLETIONS, {"frobnicate": 1}, "frobnicate"),
        (CHAT, {"messages": [{"role": "user", "content": "Hi", "mood": "happy"}]}, "messages.0.mood"),
        (CHAT, {"stream_options": {"include_usage": True, "chunk_size": 3}}, "stream_options.chunk_size"),
        (COMPLETIONS, {"best_of": 3}, "best_of"),
        (CHAT, {"logit_bias": {"99999999": 1}}, "logit_bias"),
        (COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias.5"),
        (CHAT, {"logit_bias": {"a": 1}}, "logit_bias"),
        (CHAT, {"metadata": {"a": "b"}}, "metadata"),
        (CHAT, {"store": True}, "store"),
        (CHAT, {"audio": {"voice": "alloy"}}, "audio"),
        (CHAT, {"functions": [{"name": "f"}]}, "functions"),
        (CHAT, {"reasoning_effort": "high"}, "reasoning_effort"),
        (CHAT, {"service_tier": "flex"}, "service_tier"),
        (CHAT, {"modalities": ["text", "audio"]}, "modalities.1"),
        (CHAT, {"tool_choice": "required"}, "tool_choice"),
        (CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
        (CHAT, {"response_format": {"type": "xml"}}, "response_format"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
         "response_format"),
        (COMPLETIONS, {"response_format": {"type": "regex", "regex": "(a"}}, "response_format"),
        (CHAT, {"response_format": {"type": "grammar", "grammar": "start: nowhere"}}, "response_format"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"type": "object", "propertyNames": {"maxLength": 3}}}}},
         "response_format"),
        (CHAT, {"response_format": {"type": "json_object"}, "tools": [TOOL]}, "response_format"),
        (CHAT, {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
    ids=lambda v: v if isinstance(v, str) and not v.startswith("/") else None,
)
async def test_no_field_is_silently_ignored(server: Server, path: str, change: dict, param: str) -> None:
    body = {**(PROMPT if path == COMPLETIONS else CHAT_BODY), **change}
    status, error = await server.post(path, body)
    assert_error(status, error, 400, param=param)


async def test_openai_fields_that_ask_for_nothing_are_accepted(server: Server) -> None:
    # what the openai client sends when a caller passes defaults, or echoes a reply back
    reply = {"role": "assistant", "content": "Hello!", "refusal": None, "audio": None, "function_call": None,
             "annotations": None, "tool_calls": None}
    status, body = await server.post(CHAT, {**CHAT_BODY, "parallel_tool_calls": False, "store": False,
                                            "service_tier": "auto", "modalities": ["text"], "metadata": None,
                                            "messages": [CHAT_BODY["messages"][0], reply, CHAT_BODY["messages"][0]]})
    assert status == 200, body
    status, body = await server.post(COMPLETIONS, {**PROMPT, "best_of": 1})
    assert status == 200, body


@pytest.mark.parametrize("depth", [65, 100_000])
async def test_a_body_nested_too_deep_is_a_400(server: Server, depth: int) -> None:
    nested = "[" * depth + "]" * depth
    data = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hi"}}], "x": {nested}}}'
    async with server.session.post(CHAT, data=data.encode(), headers={"Content-Type": "application/json"}) as r:
        body = await r.json()
    assert_error(r.status, body, 400)
    assert "nested" in body["error"]["message"]


async def test_unknown_model_is_404(server: Server) -> None:
    status, body = await server.post(CHAT, {**CHAT_BODY, "model": "gpt-4"})
    assert_error(status, body, 404, param="model", code="model_not_found")


# ------------------------------------------------------------------- prompts and lengths


async def test_prompt_longer_than_context(server: Server) -> None:
    ids = [100] * server.engine.limits.max_model_len
    status, body = await server.post(COMPLETIONS, {**PROMPT, "prompt": ids})
    assert_error(status, body, 400, param="prompt", code="context_length_exceeded")
    assert str(server.engine.limits.max_model_len) in body["error"]["message"]


async def test_max_tokens_past_context(server: Server) -> None:
    context = server.engine.limits.max_model_len
    ids = [100] * (context - 100)
    status, body = await server.post(COMPLETIONS, {**PROMPT, "prompt": ids, "max_tokens": 200})
    assert_error(status, body, 400, param="max_tokens", code="context_length_exceeded")
    assert str(context - 100) in body["error"]["message"] and "200" in body["error"]["message"]


async def test_max_tokens_past_limit(server: Server) -> None:
    status, body = await server.post(CHAT, {**CHAT_BODY, "max_tokens": 5000})
    assert_error(status, body, 400, param="max_tokens")
    assert "4096" in body["error"]["message"]


async def test_request_bigger_than_kv_cache(server: Server) -> None:
    # fits the context, but not the KV cache: the engine's own check, mapped by errors.py
    capacity = server.engine.limits.num_kv_blocks * server.engine.limits.block_size
    ids = [100] * (capacity - 10)
    status, body = await server.post(COMPLETIONS, {**PROMPT, "prompt": ids, "max_tokens": 100})
    assert_error(status, body, 400, param="max_tokens")


@pytest.mark.parametrize("bad_id", [-1, 10**9], ids=["negative", "past_vocab"])
async def test_invalid_token_ids(server: Server, bad_id: int) -> None:
    status, body = await server.post(COMPLETIONS, {**PROMPT, "prompt": [1, 2, bad_id]})
    assert_error(status, body, 400, param="prompt")


async def test_token_id_at_vocab_size(server: Server, llm: LLMEngine) -> None:
    status, body = await server.post(COMPLETIONS, {**PROMPT, "prompt": [[5], [server.engine.limits.vocab_size]]})
    assert_error(status, body, 400, param="prompt")
    assert server.engine.snapshot.running == 0 and server.engine.snapshot.waiting == 0


@pytest.mark.parametrize("prompt", ["", [], [[]], ["ok", ""]], ids=["string", "list", "nested", "one_of_batch"])
async def test_empty_prompt(server: Server, prompt: object) -> None:
    assert_error(*await server.post(COMPLETIONS, {**PROMPT, "prompt": prompt}), 400, param="prompt")


async def test_too_many_prompts(server: Server) -> None:
    assert_error(*await server.post(COMPLETIONS, {**PROMPT, "prompt": ["a"] * 65}), 400, param="prompt")


async def test_empty_messages(server: Server) -> None:
    assert_error(*await server.post(CHAT, {**CHAT_BODY, "messages": []}), 400, param="messages")


async def test_chat_template_raise_exception(server: Server, llm: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    template = (
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be first') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    )
    monkeypatch.setattr(server.engine.tokenizer, "chat_template", template)
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]
    status, body = await server.post(CHAT, {**CHAT_BODY, "messages": messages})
    assert_error(status, body, 400, param="messages")
    assert "System message must be first" in body["error"]["message"]


async def test_chat_template_kwargs_reach_the_template(server: Server, llm: LLMEngine,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's chat_template_kwargs: Qwen3's template closes an empty think block when
    enable_thinking is false (the same test as its own); the server's own variables are refused."""
    template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                "{% if enable_thinking is defined and enable_thinking is false %}"
                "{{ '<think>\n\n</think>\n\n' }}{% endif %}")
    monkeypatch.setattr(server.engine.tokenizer, "chat_template", template)
    body = {**CHAT_BODY, "max_tokens": 1}
    status, plain = await server.post(CHAT, body)
    assert status == 200, plain
    status, closed = await server.post(CHAT, {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200, closed
    think = len(server.engine.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert closed["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + think
    status, refused = await server.post(CHAT, {**body, "chat_template_kwargs": {"messages": []}})
    assert_error(status, refused, 400, param="chat_template_kwargs")


async def test_chat_template_type_error(server: Server, llm: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    # a template doing arithmetic on client input: not a jinja error, still the client's 400
    monkeypatch.setattr(server.engine.tokenizer, "chat_template", "{{ messages[0]['content'] + 1 }}")
    assert_error(*await server.post(CHAT, CHAT_BODY), 400, param="messages")


# ---------------------------------------------------------------------------------- routing


async def test_unknown_path_is_json_404(server: Server) -> None:
    status, body = await server.get("/v1/nothing")
    assert_error(status, body, 404)


async def test_wrong_method_is_json_405(server: Server) -> None:
    async with server.session.get(COMPLETIONS) as r:
        body = await r.json()
        assert "POST" in r.headers["Allow"]
    assert_error(r.status, body, 405)



async def test_a_bug_is_a_500_in_the_same_shape(server: Server, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(server.engine, "submit", broken)
    status, body = await server.post(COMPLETIONS, PROMPT)
    assert status == 500 and body["error"]["type"] == "server_error" and "boom" not in body["error"]["message"]
    assert "boom" in caplog.text  # logged with its traceback
