"""POST /v1/embeddings on the default model (SmolLM2: a generate model whose pooler is mean and
normalize) through the official openai client over a real socket: base64 (the client's default)
and float vectors equal, token-id inputs equal their texts', truncate_prompt_tokens, the pooling
class, and every bad input a 4xx in OpenAI's shape, with no engine request left behind."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import math
import struct
import time
from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio
from apiserver import MODEL, Server, assert_error, serve

from inferd.api.errors import APIError
from inferd.api.openai.embeddings import check_dimensions, embedding_vector
from inferd.engine.config import EngineConfig
from inferd.engine.protocol import EngineOutput
from inferd.engine.llm_engine import LLMEngine
from inferd.settings.config import Settings

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

EMBEDDINGS = "/v1/embeddings"
CONTEXT = 128  # the short server's context: its pooler reads at most CONTEXT - 1 tokens
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Der Hund schläft.", "def fib(n): return n"]


@pytest_asyncio.fixture
async def short(served_weights: tuple) -> AsyncIterator[Server]:
    """A server over the default weights with a short context and at most 4 inputs a request."""
    llm = LLMEngine(*served_weights, EngineConfig.of(kv_cache_memory=32 * 2**20, max_model_len=CONTEXT))
    settings = Settings()
    settings = settings.model_copy(update={"limits": settings.limits.model_copy(update={"max_prompts": 4})})
    async with serve(llm, settings) as s:
        yield s


def client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused", max_retries=0)


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


async def test_texts_in_base64_and_float_are_the_same_unit_vectors(short: Server) -> None:
    api = client(short)
    raw = await api.embeddings.with_raw_response.create(model=MODEL, input=TEXTS)  # (base64: the client's default)
    assert raw.headers["x-inferd-model"].startswith(MODEL)
    b64 = raw.parse()
    floats = await api.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    dimensions = short.engine.limits.pooler.dimensions
    assert b64.model == floats.model == MODEL and b64.object == "list"
    assert [d.index for d in floats.data] == [0, 1, 2]
    for x, y in zip(b64.data, floats.data):
        assert x.object == "embedding" and len(x.embedding) == dimensions
        assert close(x.embedding, y.embedding)  # (base64 is float32)
        assert math.isclose(math.fsum(v * v for v in y.embedding), 1.0, abs_tol=1e-4)
    assert not close(floats.data[0].embedding, floats.data[1].embedding, 1e-3)
    tokens = sum(len(short.engine.tokenizer.encode_document(t)) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    # each text alone: the vector it had in the batch
    alone = await api.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    assert len(alone.data) == 1 and close(alone.data[0].embedding, floats.data[1].embedding, 1e-4)


async def test_token_ids_embed_as_their_text_and_the_pooling_class_runs_them(short: Server) -> None:
    api, tokenizer = client(short), short.engine.tokenizer
    ids = [tokenizer.encode_document(t) for t in TEXTS[:2]]
    texts = await api.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    batch = await api.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = await api.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert all(close(b.embedding, t.embedding) for b, t in zip(batch.data, texts.data))
    assert close(one.data[0].embedding, texts.data[0].embedding)
    assert one.usage.prompt_tokens == len(ids[0])
    pooling = short.engine.limits.policy.pooling_default
    classes = {c.name: c for c in short.engine.snapshot.classes}
    assert classes[pooling].prompt_tokens >= 2 * sum(map(len, ids))  # (mean pooling: no cached prefix)
    assert classes[pooling].finished.get("stop", 0) >= 5
    # /metrics counts them apart from generations
    async with short.session.get("/metrics") as r:
        metrics = await r.text()
    assert f'inferd_model_pooling_inputs_total{{model="{MODEL}",revision=' in metrics


async def test_too_long_is_refused_unless_truncated_to_the_last_tokens(short: Server) -> None:
    api, tokenizer = client(short), short.engine.tokenizer
    longest = short.engine.limits.pooler.max_prompt_tokens
    assert longest == CONTEXT - 1
    text = " ".join(TEXTS * 20)
    ids = tokenizer.encode_document(text)
    assert len(ids) > longest
    status, body = await short.post(EMBEDDINGS, {"model": MODEL, "input": text})
    assert_error(status, body, 400, param="input", code="context_length_exceeded")
    assert str(longest) in body["error"]["message"]
    assert_error(*await short.post(EMBEDDINGS, {"model": MODEL, "input": [ids]}), 400, param="input",
                 code="context_length_exceeded")
    for keep in (16, -1):
        kept = ids[-(longest if keep == -1 else keep):]
        truncated = await api.embeddings.create(model=MODEL, input=text, encoding_format="float",
                                                extra_body={"truncate_prompt_tokens": keep})
        tail = await api.embeddings.create(model=MODEL, input=kept, encoding_format="float")
        assert truncated.usage.prompt_tokens == len(kept)
        assert close(truncated.data[0].embedding, tail.data[0].embedding)
    assert_error(*await short.post(EMBEDDINGS, {"model": MODEL, "input": text, "truncate_prompt_tokens": longest + 1}),
                 400, param="truncate_prompt_tokens")
    # a text whose size alone is too long is refused before it is tokenized
    status, body = await short.post(EMBEDDINGS, {"model": MODEL, "input": "x" * 10**6})
    assert_error(status, body, 400, param="input", code="context_length_exceeded")


@pytest.mark.parametrize(("change", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [49152]}, "input"),  # (the vocabulary: [0, 49152))
    ({"input": [[5], [-1]]}, "input"),
    ({"input": 5}, "input"),
    ({"input": [1.5]}, "input"),
    ({"input": [True]}, "input"),
    ({"input": [["a"]]}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": ["a"] * 5}, "input"),  # (max_prompts: 4)
    ({"encoding_format": "int8"}, "encoding_format"),
    ({"dimensions": 64}, "dimensions"),  # (no Matryoshka)
    ({"dimensions": 0}, "dimensions"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"priority": "nonesuch"}, "priority"),
    ({"stream": True}, "stream"),
])
async def test_bad_requests_are_400s_naming_the_field(short: Server, change: dict, param: str) -> None:
    assert_error(*await short.post(EMBEDDINGS, {"model": MODEL, "input": "Hello", **change}), 400, param=param)


async def test_the_client_sees_openai_errors(short: Server) -> None:
    api = client(short)
    with pytest.raises(openai.NotFoundError) as unknown:
        await api.embeddings.create(model="nonesuch", input="Hello")
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as dimensions:
        await api.embeddings.create(model=MODEL, input="Hello", dimensions=64)
    assert dimensions.value.param == "dimensions"
    # a generate model is no reranker
    for path, body in (("/v1/rerank", {"query": "q", "documents": ["d"]}),
                       ("/v1/score", {"text_1": "q", "text_2": "d"})):
        assert_error(*await short.post(path, {"model": MODEL, **body}), 400, param="model", code="wrong_task")


async def test_dimensions_cut_a_matryoshka_vector_and_normalize_it_again(llm: LLMEngine) -> None:
    """(No served model is Matryoshka: the default one's limits, its pooler declared one.)"""
    pooler = llm.limits.pooler
    limits = dataclasses.replace(llm.limits, pooler=dataclasses.replace(pooler, matryoshka=True))
    check_dimensions(MODEL, limits, pooler.dimensions)
    with pytest.raises(APIError) as e:
        check_dimensions(MODEL, limits, pooler.dimensions + 1)
    assert e.value.status == 400 and e.value.param == "dimensions"
    out = EngineOutput(0, [], "", finished=True, finish_reason="stop", pooled=[3.0, 4.0, 12.0])
    assert embedding_vector(out, limits, 2, "float") == pytest.approx([0.6, 0.8])
    assert embedding_vector(out, limits, None, "float") == [3.0, 4.0, 12.0]
    packed = base64.b64decode(embedding_vector(out, limits, 2, "base64"))  # type: ignore[arg-type]
    assert struct.unpack("<2f", packed) == pytest.approx((0.6, 0.8))


async def test_a_generate_model_with_embeddings_off_answers_none(served_weights: tuple) -> None:
    llm = LLMEngine(*served_weights, EngineConfig.of(kv_cache_memory=32 * 2**20, max_model_len=CONTEXT,
                                                      embeddings=False))
    async with serve(llm) as server:
        status, body = await server.post(EMBEDDINGS, {"model": MODEL, "input": "Hello"})
    assert_error(status, body, 400, param="model", code="wrong_task")
    assert "embeddings" in body["error"]["message"]


async def test_a_client_that_leaves_takes_every_input_with_it(server: Server) -> None:
    """Long inputs (~20 s of prefill here, more than the KV cache holds at once), and the client
    gone once all of them are in the engine: every one aborted, queued or running, within a poll."""
    text = " ".join(TEXTS * 20)  # (~500 tokens)
    posted = asyncio.ensure_future(server.session.post(EMBEDDINGS, json={"model": MODEL, "input": [text] * 16}))
    deadline = time.monotonic() + 5
    while server.engine.open_requests < 16:  # (submitted together: all at once)
        assert time.monotonic() < deadline and not posted.done()
        await asyncio.sleep(0.01)
    posted.cancel()  # (the connection closes)
    deadline = time.monotonic() + 3
    while server.engine.open_requests or server.engine.snapshot.running or server.engine.snapshot.waiting:
        assert time.monotonic() < deadline, "the inputs ran on after their client left"
        await asyncio.sleep(0.02)
