"""The endpoints on the real default model: greedy text streamed and not, usage, n, batches,
logprobs, the small endpoints, and blocks coming back after finishes and disconnects."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import openai
import pytest
from apiserver import MODEL, Server, assert_error, data_events, serve

from inferd.settings.config import Settings

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

GREEDY = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CHAT = {**GREEDY, "messages": [{"role": "user", "content": "What is the capital of France?"}]}


async def wait_idle(server: Server, within: float = 1.0) -> dict[str, Any]:
    """/v1/status once no request holds a block, failing after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        status, body = await server.get("/v1/status")
        assert status == 200
        if body["kv_blocks_used"] == 0 and body["running"] == 0 and body["waiting"] == 0:
            return body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.02)


async def wait_blocks_free(server: Server, within: float = 1.0) -> None:
    """Wait until the engine holds no request and no block (its published snapshot)."""
    deadline = time.monotonic() + within

    def held() -> tuple[int, int, int]:
        s = server.engine.snapshot
        return s.running, s.waiting, s.kv_blocks_used

    while any(held()):
        assert time.monotonic() < deadline, held()
        await asyncio.sleep(0.02)


def check_sse(response: aiohttp.ClientResponse, events: list[str]) -> list[Any]:
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-cache"
    assert response.headers["X-Accel-Buffering"] == "no"
    assert events[-1] == "data: [DONE]"
    chunks = data_events(events)
    ids = [e.split("\n")[0].removeprefix("id: ") for e in events[:-1]]
    assert ids == [f"{chunks[0]['id']}:{n}" for n in range(len(ids))]  # <response id>:<sequence number>
    return chunks


def counts(usage: dict[str, Any]) -> dict[str, Any]:
    """Usage without prompt_tokens_details and prompt_cache (a repeated prompt's cached tokens
    differ) and without the speculative extension (present where the request drafted)."""
    return {k: v for k, v in usage.items() if k not in ("prompt_tokens_details", "prompt_cache", "speculative")}


# ------------------------------------------------------------------------------ completions


async def test_completion_streamed_equals_non_streamed(server: Server) -> None:
    body = {**GREEDY, "prompt": "Once upon a time"}
    status, full = await server.post("/v1/completions", body)
    assert status == 200, full
    [choice] = full["choices"]
    assert full["object"] == "text_completion" and full["model"] == MODEL and full["id"].startswith("cmpl-")
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    prompt_tokens = len(server.engine.tokenizer.encode("Once upon a time"))
    assert counts(full["usage"]) == {"prompt_tokens": prompt_tokens, "completion_tokens": 8,
                                     "total_tokens": prompt_tokens + 8}

    response, events = await server.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    chunks = check_sse(response, events)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == choice["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and counts(chunks[-1]["usage"]) == counts(full["usage"])
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    await wait_idle(server)


async def test_completion_with_token_ids_and_stop(server: Server) -> None:
    ids = server.engine.tokenizer.encode("The first five letters of the alphabet are")
    status, full = await server.post("/v1/completions", {**GREEDY, "prompt": ids, "max_tokens": 16})
    assert status == 200
    text = full["choices"][0]["text"]
    stop = text.split()[2]
    status, cut = await server.post("/v1/completions", {**GREEDY, "prompt": ids, "max_tokens": 16, "stop": [stop]})
    assert cut["choices"][0] == {"index": 0, "text": text[: text.index(stop)], "logprobs": None, "finish_reason": "stop"}


async def test_echo_with_logprobs_scores_the_prompt_in_vllms_layout(server: Server) -> None:
    """What lm-evaluation-harness's loglikelihood tasks send: echo, logprobs, max_tokens 0 (the
    prompt alone) or 1; they read token_logprobs[context:] and top_logprobs."""
    tokenizer = server.engine.tokenizer

    async def score(prompt: str, max_tokens: int = 0) -> dict[str, Any]:
        status, body = await server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True,
                                                             "logprobs": 2, "max_tokens": max_tokens, "temperature": 0})
        assert status == 200, body
        return body

    body = await score("The capital of France is Paris")
    [choice] = body["choices"]
    ids = tokenizer.encode("The capital of France is Paris")
    lp = choice["logprobs"]
    assert choice["text"] == "The capital of France is Paris" and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert all(v <= max(top.values()) + 1e-6 for v, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    wrong = await score("The capital of France is Banana")
    assert lp["token_logprobs"][-1] > wrong["choices"][0]["logprobs"]["token_logprobs"][-1]  # the model knows
    # max_tokens 1: the prompt's entries, then the completion's, its offset after the prompt's text
    one = (await score("The capital of France is", max_tokens=1))["choices"][0]
    assert one["text"].startswith("The capital of France is") and len(one["logprobs"]["tokens"]) == len(ids)
    assert one["logprobs"]["token_logprobs"][: len(ids) - 1] == lp["token_logprobs"][: len(ids) - 1]
    assert one["logprobs"]["text_offset"][-1] == len("The capital of France is")
    assert_error(*await server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 0}), 400,
                 param="max_tokens")
    assert_error(*await server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "echo": True,
                                                        "stream": True}), 400, param="echo")
    await wait_idle(server)


async def test_n_and_batched_prompts(server: Server) -> None:
    prompts = ["The sky is", "My name is"]
    singles = []
    for prompt in prompts:
        status, body = await server.post("/v1/completions", {**GREEDY, "prompt": prompt})
        singles.append(body["choices"][0]["text"])
    status, body = await server.post("/v1/completions", {**GREEDY, "prompt": prompts, "n": 2})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    # choice index = prompt * n + choice; greedy choices of one prompt agree
    assert [c["text"] for c in body["choices"]] == [singles[0], singles[0], singles[1], singles[1]]
    prompt_tokens = sum(len(server.engine.tokenizer.encode(p)) for p in prompts)
    assert counts(body["usage"]) == {"prompt_tokens": prompt_tokens, "completion_tokens": 32,
                                     "total_tokens": prompt_tokens + 32}

    response, events = await server.stream("/v1/completions", {**GREEDY, "prompt": prompts, "n": 2})
    texts = ["", "", "", ""]
    for chunk in check_sse(response, events):
        [choice] = chunk["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == [c["text"] for c in body["choices"]]
    await wait_idle(server)


async def test_completion_logprobs(server: Server) -> None:
    body = {**GREEDY, "prompt": "One, two, three,", "logprobs": 2}
    status, full = await server.post("/v1/completions", body)
    [choice] = full["choices"]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 8
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert len(top) == 2 and max(top.values()) == pytest.approx(lp, abs=1e-4) and top[token] == pytest.approx(lp, abs=1e-4)
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets

    response, events = await server.stream("/v1/completions", body)
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in check_sse(response, events):
        for key, values in chunk["choices"][0]["logprobs"].items():
            streamed[key] += values
    assert streamed["tokens"] == logprobs["tokens"] and streamed["text_offset"] == logprobs["text_offset"]


# ------------------------------------------------------------------------------------- chat


async def test_chat_streamed_equals_non_streamed(server: Server) -> None:
    status, full = await server.post("/v1/chat/completions", CHAT)
    assert status == 200, full
    [choice] = full["choices"]
    assert full["object"] == "chat.completion" and full["id"].startswith("chatcmpl-")
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    tokenizer = server.engine.tokenizer
    rendered = tokenizer.apply_chat_template(CHAT["messages"], add_generation_prompt=True)
    prompt_tokens = len(tokenizer.encode(rendered, add_special_tokens=False))
    assert counts(full["usage"]) == {"prompt_tokens": prompt_tokens, "completion_tokens": 8,
                                     "total_tokens": prompt_tokens + 8}

    response, events = await server.stream("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
    chunks = check_sse(response, events)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert content == choice["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:-1]][-1] == "length"
    assert chunks[-1]["choices"] == [] and counts(chunks[-1]["usage"]) == counts(full["usage"])
    await wait_idle(server)


async def test_chat_n_and_logprobs(server: Server) -> None:
    body = {**CHAT, "n": 2, "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 4, "max_tokens": 100}
    status, full = await server.post("/v1/chat/completions", body)
    assert status == 200, full
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert full["usage"]["completion_tokens"] == 8  # max_completion_tokens won over max_tokens
    for choice in full["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 4
        for entry in content:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert bytes(entry["bytes"]).decode() == entry["token"]
            assert len(entry["top_logprobs"]) == 3
            assert set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}
        assert "".join(e["token"] for e in content) == choice["message"]["content"]

    response, events = await server.stream("/v1/chat/completions", body)
    chunks = check_sse(response, events)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    tokens = {0: 0, 1: 0}
    for chunk in chunks[2:]:
        [choice] = chunk["choices"]
        tokens[choice["index"]] += len(choice["logprobs"]["content"])
    assert tokens == {0: 4, 1: 4}


# ---------------------------------------------------------------------- the small endpoints


async def test_models(server: Server) -> None:
    status, body = await server.get("/v1/models")
    assert status == 200
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["object"] == "model"


async def test_a_model_is_retrieved_by_name_with_the_official_client(server: Server) -> None:
    client = openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused", max_retries=0)
    try:
        card = await client.models.retrieve(MODEL)
        assert card.id == MODEL and card.object == "model"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("no-such-model")
        assert missing.value.code == "model_not_found"
    finally:
        await client.close()


async def test_tokenizer_info(server: Server) -> None:
    status, info = await server.get("/tokenizer_info")
    assert status == 200, info
    tokenizer = server.engine.tokenizer
    assert info["eos_token"] == tokenizer.eos_token and info["eos_token_id"] == tokenizer.eos_token_id
    assert info["bos_token"] == tokenizer.bos_token and info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == server.engine.limits.max_model_len and info["vocab_size"] == tokenizer.vocab_size
    status, body = await server.get("/tokenizer_info?model=nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"


async def test_usage_counts_the_prompt_tokens_the_cache_served(server: Server) -> None:
    """usage.prompt_tokens_details.cached_tokens, on both endpoints, whole and streamed."""
    prompt = f"{time.time_ns()} " + " ".join(f"item {i} of the list" for i in range(12))  # ~70 tokens, new
    body = {**GREEDY, "prompt": prompt, "max_tokens": 1}
    status, cold = await server.post("/v1/completions", body)
    assert status == 200 and cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    status, warm = await server.post("/v1/completions", body)
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 48 and cached % 16 == 0 and cached < warm["usage"]["prompt_tokens"]  # whole blocks
    response, events = await server.stream("/v1/chat/completions", {
        **CHAT, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
        "stream_options": {"include_usage": True}})
    status, again = await server.post("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": prompt}],
                                                               "max_tokens": 1})
    assert check_sse(response, events)[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48


async def test_continuous_usage_stats_put_usage_on_every_chunk(server: Server) -> None:
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it on every streamed request)."""
    for path, body in (("/v1/completions", {**GREEDY, "prompt": "Once upon a time"}), ("/v1/chat/completions", CHAT)):
        response, events = await server.stream(path, {**body, "stream_options": {"include_usage": True,
                                                                                 "continuous_usage_stats": True}})
        chunks = check_sse(response, events)
        token_chunks = [c for c in chunks if c["choices"] and c["usage"]["completion_tokens"] > 0]
        seen = [c["usage"]["completion_tokens"] for c in token_chunks]  # (speculation: several tokens a chunk)
        assert seen == sorted(set(seen)) and seen[0] == 1 and seen[-1] == 8
        assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in token_chunks)
        assert counts(chunks[-1]["usage"]) == counts(token_chunks[-1]["usage"])


async def test_openapi(server: Server) -> None:
    async with server.session.get("/openapi.json") as r:
        assert r.status == 200
        doc = json.loads(await r.text())
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/status", "/health"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "ChatCompletionChunk", "ErrorResponse"} <= set(schemas)
    assert "temperature" in schemas["CompletionRequest"]["properties"]

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            return ([node["$ref"]] if "$ref" in node else []) + [r for v in node.values() for r in refs(v)]
        return [r for v in node for r in refs(v)] if isinstance(node, list) else []

    for ref in refs(doc):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref


async def test_health_and_a_dead_engine(server: Server) -> None:
    assert await server.get("/health") == (200, {"status": "ok"})
    await server.engine.stop()
    status, _ = await server.get("/health")
    assert status == 503
    async with server.session.post("/v1/completions", json={**GREEDY, "prompt": "Hi"}) as r:
        assert_error(r.status, await r.json(), 503)
        assert r.headers["Retry-After"]


async def test_status_returns_to_idle(server: Server) -> None:
    status, body = await server.get("/v1/status")
    assert {"model", "dtype", "device", "version", "uptime_seconds", "state", "max_model_len", "kv_blocks_total",
            "kv_blocks_used", "kv_blocks_cached", "kv_usage_ratio", "running", "waiting", "steps", "preemptions",
            "timeouts", "rejections", "prefix_cache_queries", "prefix_cache_hits", "shed_level", "shed_actions",
            "throughput", "device_memory", "state_slots", "speculation", "cache_tiers", "engine_healthy", "step_failures",
            "oom_events_last_minute",
            "token_budget", "resumable_streams_detached", "event_loop_lag_seconds", "classes", "requests",
            "tenants", "drift", "models", "routes"} == set(body)
    assert body["engine_healthy"] is True and body["token_budget"] == 512
    assert body["speculation"]["method"] == "auto" and body["speculation"]["off_reason"] is None
    assert (body["dtype"], body["device"], body["device_memory"], body["state_slots"]) == ("bfloat16", "cpu", None, None)
    assert body["classes"][0]["limits"]["ttft_target"] == 2.0
    assert body["model"] == MODEL and body["kv_blocks_total"] > 0
    assert [c["name"] for c in body["classes"]] == ["interactive", "batch"]
    before = body["classes"][1]["generation_tokens"]
    answers = await asyncio.gather(*(server.post("/v1/completions", {**GREEDY, "prompt": f"Item {i}:",
                                                                     "priority": "batch"}) for i in range(3)))
    assert [status for status, _ in answers] == [200] * 3, answers
    idle = await wait_idle(server)
    assert idle["steps"] > body["steps"]
    batch = idle["classes"][1]
    assert batch["generation_tokens"] - before == 3 * GREEDY["max_tokens"]
    assert batch["running"] == batch["waiting"] == batch["kv_blocks_used"] == 0
    assert batch["ttft_p50_seconds"] > 0 and batch["finished"]["length"] >= 3


# ---------------------------------------------------------------------- disconnects, shutdown


async def read_events(response: aiohttp.ClientResponse, count: int) -> list[Any]:
    events = []
    while len(events) < count:
        line = (await response.content.readline()).decode()
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
    return events


async def test_disconnect_mid_stream_frees_blocks(server: Server) -> None:
    body = {**CHAT, "max_tokens": 1000, "stream": True}
    async with server.session.post("/v1/chat/completions", json=body) as r:
        assert r.status == 200
        await read_events(r, 3)  # the role, then two tokens
        assert server.engine.snapshot.kv_blocks_used > 0
        r.close()  # the client goes away
    await wait_blocks_free(server, within=1.0)


async def test_client_timeout_on_non_streaming_frees_blocks(server: Server) -> None:
    body = {**CHAT, "max_tokens": 1000}
    with pytest.raises(asyncio.TimeoutError):
        await server.session.post("/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.5))
    await wait_blocks_free(server, within=1.0)


async def test_status_shows_blocks_freed_by_a_disconnect(server: Server) -> None:
    body = {**CHAT, "max_tokens": 1000, "stream": True}
    async with server.session.post("/v1/chat/completions", json=body) as r:
        await read_events(r, 3)
        r.close()
    await wait_blocks_free(server, within=1.0)
    await wait_idle(server, within=0.5)


async def test_shutdown_ends_open_streams(server: Server) -> None:
    body = {**CHAT, "max_tokens": 1000, "stream": True}
    async with server.session.post("/v1/chat/completions", json=body) as r:
        await r.content.readline()
        closing = asyncio.create_task(server.test_server.close())
        rest = (await asyncio.wait_for(r.content.read(), 5)).decode()
        await closing
    events = [e for e in rest.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = data_events(events)[-1]
    assert error["error"]["type"] == "service_unavailable" and "shutting down" in error["error"]["message"]


async def test_keepalive_while_nothing_arrives(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    step = llm.step

    def slow_step() -> Any:
        time.sleep(0.25)  # a long prefill, say: nothing for the stream to send meanwhile
        return step()

    monkeypatch.setattr(llm, "step", slow_step)
    settings = Settings.model_validate({"server": {"keepalive_seconds": 0.05}})
    async with serve(llm, settings) as server:
        body = {**GREEDY, "prompt": "Hi", "max_tokens": 3}
        response, events = await server.stream("/v1/completions", body)
        # the official client reads past keep-alives that come after an event with an id
        client = openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused", max_retries=0)
        chunks = [c async for c in await client.completions.create(model=MODEL, prompt="Hi", max_tokens=3,
                                                                   temperature=0, stream=True)]
        await client.close()
    comments = [line for e in events for line in e.split("\n") if line.startswith(":")]
    assert comments and set(comments) == {": keep-alive"}  # some between the tokens
    events = ["\n".join(line for line in e.split("\n") if not line.startswith(":")) for e in events]
    check = check_sse(response, [e for e in events if e])
    assert check[-1]["choices"][0]["finish_reason"] == "length"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length" and len(chunks) == 3
