"""The OpenAI protocol as pydantic models: requests (validated once, here) and responses.

Requests are strict (no "10" for 10, no true for 1) and ignore unknown fields, since OpenAI
clients send some we do not know. Ranges that depend on the settings (n <= limits.max_n,
max_tokens <= limits.max_tokens_limit, the context length) are checked by the handlers.

The response models document the API (GET /openapi.json) and build non-streaming replies;
streamed chunks are plain dicts in the same shapes (see inferd/api/chat.py, completions.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - 128  # torch generator range, less room for seed + choice


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


StopField = Annotated[str | Annotated[list[str], Field(max_length=4)] | None, Field(default=None)]


class SamplingFields(_Request):
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

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# ------------------------------------------------------------------------------ completions


class CompletionRequest(SamplingFields):
    # a string, token ids, or a batch of either; each prompt becomes its own engine request
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:  # one error per union member: say what is allowed instead
            raise ValueError(
                "must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
            ) from None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("suffix is not supported")
        return value


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "timeout"] | None


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(_Response):
    """One `data:` event of a streamed completion (the last may carry only usage)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ------------------------------------------------------------------------------------- chat


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # overrides max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprobEntry] | None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "timeout"] | None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "timeout"] | None


class ChatCompletionChunk(_Response):
    """One `data:` event of a streamed chat completion (the last may carry only usage)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------------- other replies


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inferd"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorDetail


class HealthResponse(_Response):
    status: Literal["ok", "unavailable"]


class ReadyResponse(_Response):
    status: Literal["loading", "ready", "draining", "not_ready"]
    reason: str | None = None  # why the inference probe failed


class ClassLimits(_Response):
    max_waiting: int
    max_queued_tokens: int
    ttft_target: float
    tpot_target: float
    queue_timeout: float | None
    ttft_timeout: float | None
    token_timeout: float | None
    total_timeout: float | None
    max_tokens: int
    kv_reserve: float
    sheddable: bool


class ClassStatus(_Response):
    name: str
    priority: int
    limits: ClassLimits
    waiting: int
    queued_tokens: int
    oldest_wait_seconds: float
    running: int
    kv_blocks_used: int
    queued_token_seconds: float
    prompt_tokens: int
    cached_prompt_tokens: int
    generation_tokens: int
    ttft_p50_seconds: float | None
    ttft_p95_seconds: float | None
    tpot_p50_seconds: float | None
    queue_time_p95_seconds: float | None
    finished: dict[str, int]
    preemptions: dict[str, int]
    timeouts: dict[str, int]
    rejections: dict[str, int]
    deadline_misses: dict[str, int]


class RequestStatus(_Response):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    id: int
    index: int  # the choice, for n > 1
    class_: str = Field(alias="class")
    state: Literal["running", "waiting", "swapped"]
    age_seconds: float
    prompt_tokens: int
    output_tokens: int
    ttft_seconds: float | None


class Throughput(_Response):
    generation_tokens_per_second: float  # over the last 10 s
    prompt_tokens_per_second: float
    history: list[float]  # generation tokens in each of the last 60 s, oldest first


class DeviceMemory(_Response):
    used_bytes: int
    total_bytes: int


class StatusResponse(_Response):
    model: str
    dtype: str
    device: str
    version: str
    uptime_seconds: float
    state: Literal["loading", "ready", "draining", "not_ready"]
    max_model_len: int
    kv_blocks_total: int
    kv_blocks_used: int  # held by requests
    kv_blocks_cached: int  # prefix-cache blocks no request holds (evictable)
    running: int
    waiting: int
    steps: int
    preemptions: dict[str, int]  # by mode
    timeouts: dict[str, int]  # by kind
    rejections: dict[str, int]  # by reason
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    shed_level: int
    shed_actions: dict[str, int]  # load shedder transitions: "escalate", "recover", "level:N"
    kv_usage_ratio: float
    throughput: Throughput
    device_memory: DeviceMemory | None  # CUDA only
    engine_healthy: bool = True  # false after failed steps in a row, until it recovers
    step_failures: dict[str, int] = {}  # by kind: forward, request, oom
    oom_events_last_minute: int = 0
    token_budget: int = 0  # tokens per step now (halved after an out-of-memory step)
    classes: list[ClassStatus]
    requests: list[RequestStatus]  # running first, at most 100


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)
