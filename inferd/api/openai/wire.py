"""The OpenAI protocol as pydantic models: requests (validated once, here) and responses.

Requests are strict (no "10" for 10, no true for 1) and no field is silently ignored: an unknown
one is a 400 that names it, and OpenAI fields inferd does not implement are accepted only with a
value that asks for nothing (null, or their default) and refused otherwise. Ranges that depend on
the settings (n <= limits.max_n, max_tokens <= limits.max_tokens_limit, the context length, a
logit_bias token in the vocabulary) are checked by the handlers.

The response models document the API (GET /openapi.json) and build non-streaming replies;
streamed chunks are plain dicts in the same shapes (see inferd/api/openai/chat.py, completions.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from inferd.api.wire import PromptCacheUsage, RequestModel, ResponseModel

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - 128  # torch generator range, less room for seed + choice


class StreamOptions(RequestModel):
    include_usage: bool = False
    # vLLM's: usage so far on every chunk too (with include_usage), as guidellm asks for
    continuous_usage_stats: bool = False


StopField = Annotated[str | Annotated[list[str], Field(max_length=4)] | None, Field(default=None)]


class TextFormat(RequestModel):
    type: Literal["text"]


class JSONObjectFormat(RequestModel):
    type: Literal["json_object"]


class JSONSchemaSpec(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # true: a keyword the grammar engine lacks is a 400; else it is ignored


class JSONSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


class RegexFormat(RequestModel):  # extension (vLLM's guided_regex)
    type: Literal["regex"]
    regex: str = Field(min_length=1)


class ChoiceFormat(RequestModel):  # extension (vLLM's guided_choice)
    type: Literal["choice"]
    choice: list[str] = Field(min_length=1, max_length=256)


class GrammarFormat(RequestModel):  # extension: a Lark grammar as llguidance takes it
    type: Literal["grammar"]
    grammar: str = Field(min_length=1)


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat | RegexFormat | ChoiceFormat
                           | GrammarFormat, Field(discriminator="type")]
LOGIT_BIAS_MAX = 100


class SamplingFields(RequestModel):
    """The fields both endpoints share, OpenAI's and the extensions (top_k, min_p, ...)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopField
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    # token id (as a string, OpenAI's shape) -> a bias in [-100, 100] added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]] | None = None
    response_format: ResponseFormat | None = None
    # extensions (vLLM's names)
    top_k: int = Field(default=-1, ge=-1)  # -1 or 0: off
    min_p: float = Field(default=0.0, ge=0, le=1)
    ignore_eos: bool = False
    # inferd's scheduling: a priority class (name or number; unset: the default class) and
    # timeouts in seconds that may tighten the class's own, never loosen them
    priority: str | int | None = None
    queue_timeout: float | None = Field(default=None, gt=0)
    ttft_timeout: float | None = Field(default=None, gt=0)
    token_timeout: float | None = Field(default=None, gt=0)
    total_timeout: float | None = Field(default=None, gt=0)
    # inferd's streaming: text released per token, or in whole sentences or lines (no empty deltas)
    segment: Literal["token", "sentence", "line"] = "token"
    # a stream that outlives a disconnect: GET /v1/streams/<id> resumes it (api/streaming/resume.py)
    resumable: bool = False
    # vLLM's field: a secret that narrows the prefix cache to requests that send the same one
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("resumable")
    @classmethod
    def _resumable_streams_only(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("stream") is not True:
            raise ValueError("resumable needs stream: true (a plain reply has nothing to resume)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return value

    @property
    def token_bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), v) for k, v in (self.logit_bias or {}).items())

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats


# ------------------------------------------------------------------------------ completions


class CompletionRequest(SamplingFields):
    # a string, token ids, or a batch of either; each prompt becomes its own engine request
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    # the prompt before the completion, in text and (with logprobs) in logprobs, the first
    # token's null (vLLM's layout, what lm-evaluation-harness reads); with max_tokens 0, the prompt alone
    echo: bool = False
    max_tokens: int | None = Field(default=None, ge=0)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of is not supported (only best_of = n, which returns every choice)")
        return value

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:  # one error per union member: say what is allowed instead
            raise ValueError(
                "must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
            ) from None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("suffix is not supported")
        return value


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # (echo: null for the prompt's first token)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "content_filter", "timeout"] | None


class PromptTokensDetails(ResponseModel):
    cached_tokens: int  # of the prompt's tokens, how many the prefix cache supplied


class SpeculativeUsage(ResponseModel):
    """inferd's extension: speculative decoding's draft tokens for this request."""

    drafted_tokens: int  # verified
    accepted_tokens: int  # of which accepted


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    speculative: SpeculativeUsage | None = None  # (absent: nothing drafted)
    prompt_cache: PromptCacheUsage | None = Field(default=None, exclude_if=lambda value: value is None)

    @model_serializer(mode="wrap")
    def _absent_when_nothing_drafted(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("speculative") is None:
            data.pop("speculative", None)
        return data


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(ResponseModel):
    """One `data:` event of a streamed completion (the last may carry only usage)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------------- other replies


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inferd"
    max_model_len: int | None = None  # (a route's targets may differ)
    revision: str | None = None  # the revision serving it (a model or an alias)
    alias_of: str | None = None  # an alias: the model it names
    route: dict[str, float] | None = None  # a route: its targets' shares
    # a mixture-of-experts model: its experts per layer and how many each token goes through
    experts: int | None = None
    active_experts: int | None = None
    # a model (or alias): serving, loading, unloading, asleep, waking, unloaded or failed; when it
    # loads (start, on_demand) and whether it is pinned (never unloaded to make room or when idle)
    state: str | None = None
    load: str | None = None
    pinned: bool | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
