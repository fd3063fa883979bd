"""POST /v1/embeddings, /v1/rerank and /v1/score: their wire formats over the one pooling path
(api/pipeline/pooling.py). An embedding is the model's pooled vector (cut to `dimensions` and
normalized again for a Matryoshka model); a score is P(yes) of a yes/no reranker, the sigmoid of
the logit difference the engine reads at the prompt's last position.
"""

from __future__ import annotations

import base64
import math
import struct

from aiohttp import web

from inferd.api.body import read_json
from inferd.api.errors import APIError, bad_request
from inferd.api.openai.pooling_wire import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    Score,
    ScoreRequest,
    ScoreResponse,
    ScoringFields,
)
from inferd.api.pipeline.pooling import Pooled, PoolingJob, Prepare, Prompts, run_pooling
from inferd.api.streaming.generation import no_answer
from inferd.api.wire import dump
from inferd.engine.protocol import EngineLimits, EngineOutput, PoolingParams
from inferd.text.tokenizer import Tokenizer


def usage(pooled: Pooled) -> PoolingUsage:
    return PoolingUsage(prompt_tokens=pooled.prompt_tokens, total_tokens=pooled.prompt_tokens)


def _missing(field: str) -> APIError:
    """A final pooling output without its vector or score: the engine's bug, a 500."""
    return APIError(500, f"the engine finished a pooling request without its {field}", type="server_error")


# ------------------------------------------------------------------------------ embeddings


def embedding_prompts(body: EmbeddingRequest, limits: EngineLimits, tokenizer: Tokenizer) -> Prompts:
    """Each input's token ids: a text with the special tokens its tokenizer adds to one alone
    (encode_document), ids as given; the last `truncate_prompt_tokens` of each if asked."""
    assert limits.pooler is not None  # (check_task)
    longest, keep = limits.pooler.max_prompt_tokens, body.truncate_prompt_tokens
    if keep is not None and keep > longest:
        raise bad_request(f"truncate_prompt_tokens must be at most {longest} (the most this model reads at once), "
                          f"got {keep}", param="truncate_prompt_tokens")
    prompts = []
    for i, given in enumerate(body.inputs):
        if isinstance(given, str):
            if keep is None:  # (a text whose size alone shows it is too long: refused before tokenizing)
                least = len(given.encode("utf-8", "surrogatepass")) // tokenizer.bytes_per_token_bound
                if least > longest:
                    raise bad_request(f"input[{i}] has at least {least} tokens; this model reads at most {longest} "
                                      "tokens at once", param="input", code="context_length_exceeded")
            given = tokenizer.encode_document(given)
        prompts.append(given if keep is None else given[-(longest if keep == -1 else keep):])
    return prompts, PoolingParams("embed")


def embedding_vector(out: EngineOutput, limits: EngineLimits, dimensions: int | None, fmt: str) -> list[float] | str:
    """A pooled vector as answered: its first `dimensions` (normalized again), as floats or base64."""
    vector = out.pooled
    if vector is None:
        raise _missing("vector")
    if dimensions is not None:
        vector = vector[:dimensions]
        assert limits.pooler is not None
        if limits.pooler.normalize:
            norm = math.sqrt(math.fsum(v * v for v in vector))
            vector = [v / norm for v in vector] if norm > 0 else vector
    if fmt == "base64":  # (what the openai client asks for by default, and decodes)
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def check_dimensions(model: str, limits: EngineLimits, dimensions: int | None) -> None:
    """A 400 for `dimensions` on a model whose vectors are no Matryoshka ones, or past their length."""
    pooler = limits.pooler
    if dimensions is None or pooler is None:
        return
    if not pooler.matryoshka:
        raise bad_request(f"the model {model!r} does not support dimensions: its vectors are not Matryoshka "
                          "(a prefix of one is no embedding)", param="dimensions")
    if dimensions > pooler.dimensions:
        raise bad_request(f"dimensions must be in [1, {pooler.dimensions}] for the model {model!r}, got {dimensions}",
                          param="dimensions")


async def create_embeddings(request: web.Request) -> web.StreamResponse:
    body = EmbeddingRequest.model_validate(await read_json(request))

    def prepare(model: str, limits: EngineLimits, tokenizer: Tokenizer) -> Prompts:
        check_dimensions(model, limits, body.dimensions)
        return embedding_prompts(body, limits, tokenizer)

    job = PoolingJob("embed", body.model, body.priority, body.user, len(body.inputs), "input", "embd", prepare,
                     lambda: repr(body.input))
    pooled = await run_pooling(request, job)
    if pooled is None:
        return no_answer()
    data = [Embedding(index=i, embedding=embedding_vector(out, pooled.limits, body.dimensions, body.encoding_format))
            for i, out in enumerate(pooled.outputs)]
    return web.json_response(dump(EmbeddingResponse(data=data, model=pooled.model, usage=usage(pooled))))


# --------------------------------------------------------------------------- rerank, score

RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
_QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def reranker_prompt(query: str, document: str, instruction: str | None) -> tuple[str, ...]:
    """The reranker's prompt as parts, each tokenized alone and the ids joined (as Qwen3-Reranker's
    model card does; its system line and template are fixed text): the model answers "yes" or
    "no" next. Another reranker format would be chosen here."""
    pair = f"<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return _QWEN3_RERANKER_PREFIX, pair, _QWEN3_RERANKER_SUFFIX


def score_tokens(model: str, tokenizer: Tokenizer) -> tuple[int, int]:
    """The (no, yes) ids a score reads; a 400 for a model whose vocabulary spells either in more than one."""
    ids = {word: tokenizer.encode(word, add_special_tokens=False) for word in ("no", "yes")}
    for word, spelled in ids.items():
        if len(spelled) != 1:
            raise bad_request(f"the model {model!r} cannot score: {word!r} is {len(spelled)} tokens in its "
                              "vocabulary, not one", param="model", code="wrong_task")
    return ids["no"][0], ids["yes"][0]


def pair_prompts(pairs: list[tuple[str, str]], instruction: str | None) -> Prepare:
    """Each (query, document) pair's prompt ids, and the (no, yes) ids its score reads."""

    def prepare(model: str, limits: EngineLimits, tokenizer: Tokenizer) -> Prompts:
        no_yes = score_tokens(model, tokenizer)
        prompts = [[t for part in reranker_prompt(q, d, instruction)
                    for t in tokenizer.encode(part, add_special_tokens=False)] for q, d in pairs]
        return prompts, PoolingParams("score", no_yes)

    return prepare


def relevance(out: EngineOutput) -> float:
    """P(yes) of a two-way softmax over the yes and no logits: the sigmoid of their difference."""
    if out.score is None:
        raise _missing("score")
    x = out.score
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))  # (no overflow either way)


def scoring_job(body: ScoringFields, pairs: list[tuple[str, str]], param: str, id_prefix: str) -> PoolingJob:
    return PoolingJob("score", body.model, body.priority, body.user, len(pairs), param, id_prefix,
                      pair_prompts(pairs, body.instruction), lambda: repr(pairs))


async def create_rerank(request: web.Request) -> web.StreamResponse:
    body = RerankRequest.model_validate(await read_json(request))
    pooled = await run_pooling(request, scoring_job(body, [(body.query, d) for d in body.documents], "documents",
                                                    "rerank"))
    if pooled is None:
        return no_answer()
    results = sorted((RerankResult(index=i, relevance_score=relevance(out),
                                   document=RerankDocument(text=body.documents[i]) if body.return_documents else None)
                      for i, out in enumerate(pooled.outputs)), key=lambda r: -r.relevance_score)
    top = results[:body.top_n] if body.top_n else results
    return web.json_response(dump(RerankResponse(id=pooled.id, model=pooled.model, usage=usage(pooled), results=top)))


async def create_score(request: web.Request) -> web.StreamResponse:
    body = ScoreRequest.model_validate(await read_json(request))
    try:
        pairs = body.pairs()
    except ValueError as e:
        raise bad_request(str(e), param="text_2") from None
    pooled = await run_pooling(request, scoring_job(body, pairs, "text_2", "score"))
    if pooled is None:
        return no_answer()
    data = [Score(index=i, score=relevance(out)) for i, out in enumerate(pooled.outputs)]
    return web.json_response(dump(ScoreResponse(id=pooled.id, created=pooled.created, model=pooled.model, data=data,
                                                usage=usage(pooled))))
