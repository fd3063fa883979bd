"""The pooling endpoints' bodies as pydantic models: /v1/embeddings (OpenAI's), /v1/rerank
(Jina's and Cohere's, as vLLM serves it) and /v1/score (vLLM's).

Strict like every request here (wire.py's rules): an unknown field is a 400 that names it. Ranges
that depend on the model (token ids in the vocabulary, `dimensions`, the input length) and on the
settings (inputs per request: limits.max_prompts) are checked by the handlers and the door.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, ValidatorFunctionWrapHandler, field_validator

from inferd.api.wire import RequestModel, ResponseModel

Priority = str | int | None  # inferd's scheduling: a class name or number (unset: the pooling class)


def _non_empty(value: Any, what: str) -> Any:
    """A 400 for an empty input, or an empty text or id list inside one (it has nothing to read)."""
    items = [value] if isinstance(value, str) else value
    if not items:
        raise ValueError(f"{what} is empty")
    for i, item in enumerate(items):
        if isinstance(item, (str, list)) and not item:
            raise ValueError(f"{what}[{i}] is empty" if not isinstance(value, str) else f"{what} is an empty string")
    return value


# ----------------------------------------------------------------------------- embeddings


class EmbeddingRequest(RequestModel):
    model: str
    # a text, texts, token ids or lists of token ids: each one engine request, submitted together
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes
    dimensions: int | None = Field(default=None, ge=1)  # a Matryoshka model's vectors cut to a prefix
    user: str | None = None
    # extensions: vLLM's (keep the last N tokens of a longer input; -1: as many as the model reads)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: Priority = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _input_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            value = handler(value)
        except ValidationError:  # one error per union member: say what is allowed instead
            raise ValueError(
                "must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
            ) from None
        return _non_empty(value, "input")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be at least 1, or -1 (as many tokens as the model reads)")
        return value

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a batch, one per engine request."""
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            return [given]  # type: ignore[list-item]
        return given  # type: ignore[return-value]


class Embedding(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # (encoding_format base64: a string)


class PoolingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int  # (nothing is generated: the prompt tokens)


class EmbeddingResponse(ResponseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: PoolingUsage


# ---------------------------------------------------------------------------- rerank, score


class ScoringFields(RequestModel):
    """What /v1/rerank and /v1/score share: a reranker reads each (query, document) pair."""

    model: str
    # the task the reranker judges by (Qwen3-Reranker's <Instruct>); unset: a web search query's
    instruction: str | None = Field(default=None, min_length=1)
    user: str | None = None
    priority: Priority = None


class RerankRequest(ScoringFields):
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=0)  # the best N results; None or 0: every one
    return_documents: bool = True  # (vLLM's and Jina's default)


class RerankDocument(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    index: int  # of the document in the request
    relevance_score: float  # P(yes) of the reranker's yes/no answer, in [0, 1]
    document: RerankDocument | None = None  # (return_documents)


class RerankResponse(ResponseModel):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]  # best first


class ScoreRequest(ScoringFields):
    # 1:N (a string, or a list of one, against each text_2) or N:N (text_1[i] against text_2[i])
    text_1: str | list[str]
    text_2: str | list[str]

    @field_validator("text_1", "text_2")
    @classmethod
    def _some(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("the list is empty")
        return value

    def pairs(self) -> list[tuple[str, str]]:
        """(query, document) pairs, in the order the scores are answered; ValueError if the
        lists' lengths do not pair."""
        queries = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        documents = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(queries) == 1:
            return [(queries[0], d) for d in documents]
        if len(queries) != len(documents):
            raise ValueError(f"text_1 has {len(queries)} texts and text_2 {len(documents)}: they pair 1 to N "
                             "or N to N")
        return list(zip(queries, documents))


class Score(ResponseModel):
    index: int
    object: Literal["score"] = "score"
    score: float  # P(yes), in [0, 1]


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Score]
    usage: PoolingUsage
