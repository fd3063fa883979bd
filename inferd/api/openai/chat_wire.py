"""The chat side of the OpenAI protocol: messages, tools, and the chat replies, whole and
streamed. The shared request fields, completions and the other replies are in wire.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from inferd.api.openai.wire import SamplingFields, Usage
from inferd.api.wire import RequestModel, ResponseModel, refuse_media



class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(RequestModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to one
    # an assistant's earlier reasoning, sent back under either name (llama.cpp's and SGLang's, vLLM's)
    reasoning_content: str | None = None
    reasoning: str | None = None
    # what the openai client echoes back from an earlier reply: accepted when null
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: None = None

    _media = field_validator("content", mode="before")(refuse_media)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(RequestModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no arguments
    strict: bool | None = None  # true: a schema keyword the grammar engine lacks is a 400


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


# OpenAI's chat fields with nothing behind them here: accepted when null, else a 400 naming them
UNSUPPORTED_CHAT_FIELDS = {
    "audio": "inferd answers in text only", "prediction": "there are no predicted outputs",
    "verbosity": "not a setting of the models served here",
    "web_search_options": "there is no web search", "functions": "use tools", "function_call": "use tool_choice",
    "metadata": "completions are not stored", "safety_identifier": "use user",
}


# what the server itself passes to a chat template
TEMPLATE_VARIABLES = {"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token"}


class ChatCompletionRequest(SamplingFields):

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # overrides max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # extra variables for the model's chat template (vLLM's field): Qwen3's enable_thinking, say
    chat_template_kwargs: dict[str, Any] | None = None
    # a thinking model's reasoning ends after this many tokens (vLLM's field): its closing marker is forced
    thinking_token_budget: int | None = Field(default=None, ge=0)
    store: Literal[False] | None = None  # completions are not stored
    service_tier: Literal["auto", "default"] | None = None  # one tier: see `priority` for classes
    modalities: list[Literal["text"]] | None = None
    audio: Any = None
    prediction: Any = None
    # a reasoning model's effort: harmony's (gpt-oss) in its system message; a thinking model's budget
    # (EFFORT_BUDGETS) unless thinking_token_budget says; a model that does not reason refuses it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    verbosity: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    metadata: Any = None
    prompt_cache_key: str | None = None  # a session: its prefix kept cached between turns (pipeline/sessions.py)
    safety_identifier: Any = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(value or {}) & TEMPLATE_VARIABLES)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)} (the request's own fields do)")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator(*UNSUPPORTED_CHAT_FIELDS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"not supported: {UNSUPPORTED_CHAT_FIELDS[info.field_name or '']}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _names_a_tool(cls, value: Any, info: ValidationInfo) -> Any:
        names = {t.function.name for t in info.data.get("tools") or []}
        if value not in (None, "none", "auto") and not names:
            raise ValueError("needs tools")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"names {value.function.name!r}, which is not among the tools")
        return value

    @property
    def calls_tools(self) -> bool:
        """Whether the model is offered the tools (tool_choice "none" hides them)."""
        return bool(self.tools) and self.tool_choice != "none"


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprobEntry] | None


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    # a thinking model's reasoning, under both names clients read (vLLM renamed the first to the
    # second and broke the clients that read the first); absent for a model that does not think
    reasoning_content: str | None = Field(default=None, exclude_if=lambda value: value is None)
    reasoning: str | None = Field(default=None, exclude_if=lambda value: value is None)


FinishReason = Literal["stop", "length", "content_filter", "timeout", "tool_calls"]


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(ResponseModel):
    """One `data:` event of a streamed chat completion (the last may carry only usage)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
