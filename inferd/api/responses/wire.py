"""OpenAI's Responses API as pydantic models: the request (validated once, here) and the reply.

Strict, as the other protocols' models: an unknown field is a 400 naming it. Fields that clients
send as hints and that ask for nothing inferd must do are accepted by name (Codex sends
`client_metadata`); `prompt_cache_key` names a session (pipeline/sessions.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from inferd.api.wire import PromptCacheUsage, RequestModel, ResponseModel, refuse_media


class TextPart(RequestModel):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # (output_text sent back)
    logprobs: list[Any] | None = None


class MessageItem(RequestModel):
    type: Literal["message"] | None = None
    id: str | None = None
    status: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    _media = field_validator("content", mode="before")(refuse_media)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    namespace: str | None = None  # a call of a namespace tool's function
    arguments: str
    status: str | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[TextPart]
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(RequestModel):
    """A reasoning item sent back: accepted and left out of the prompt (templates re-render no old reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_kind(value: Any) -> str:
    """An input item's kind: its `type`, "message" when it has none (a bare {role, content})."""
    if isinstance(value, dict):
        return value.get("type") or "message"
    return getattr(value, "type", None) or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_function(self) -> dict[str, Any]:
        """As a chat-completions tool: what the prompt's tool format and the grammars read."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters or {"type": "object"}}
        if self.description:
            function["description"] = self.description
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class NamespaceTool(RequestModel):
    """A named group of function tools (Codex sends its sub-agent tools as one): its functions are
    offered as the others are, and a call of one names the namespace."""

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    tools: list[FunctionTool] = Field(min_length=1)


TOOL_TYPES = ("function", "namespace")  # what /v1/responses runs; other types: conversation/tool_policy.py


class NamedFunction(RequestModel):
    type: Literal["function"]
    name: str


class JSONSchemaText(RequestModel):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class PlainText(RequestModel):
    type: Literal["text", "json_object"]


class TextOptions(RequestModel):
    format: Annotated[PlainText | JSONSchemaText, Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint


class Reasoning(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: str | None = None


class ResponsesRequest(RequestModel):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # TOOL_TYPES; other types: conversation/tool_policy.py
    tool_choice: Literal["auto", "none", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    store: bool | None = None  # kept for previous_response_id and GET; None: responses.store_by_default
    background: bool = False  # answered at once, generated on (kept: store must not be false)
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # a session: its prefix kept cached between turns
    # hints, accepted and not read
    safety_identifier: str | None = None
    client_metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=0)  # token logprobs: not yet

    def function_tools(self) -> list[FunctionTool]:
        """Every function the model may call: the function tools, then each namespace's."""
        return [tool for _, tool in self.namespaced_tools()]

    def namespaced_tools(self) -> list[tuple[str | None, FunctionTool]]:
        out: list[tuple[str | None, FunctionTool]] = []
        for tool in self.tools or []:
            if tool.get("type") == "namespace":
                space = NamespaceTool.model_validate(tool)
                out += [(space.name, function) for function in space.tools]
            else:
                out.append((None, FunctionTool.model_validate(tool)))
        return out


# ------------------------------------------------------------------------------ replies


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(ResponseModel):
    """A thinking model's reasoning, as it wrote it (no summary is made: `summary` stays empty)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["completed", "incomplete", "in_progress"] = "completed"


class OutputFunctionCall(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    namespace: str | None = None  # the namespace tool the function came in
    arguments: str
    status: Literal["completed", "incomplete", "in_progress"] = "completed"


class InputTokensDetails(ResponseModel):
    cached_tokens: int


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int
    prompt_cache: PromptCacheUsage | None = Field(default=None, exclude_if=lambda value: value is None)  # inferd's


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class Response(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]
    model: str
    output: list[OutputReasoning | OutputMessage | OutputFunctionCall]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False  # whether it is kept (GET /v1/responses/<id>, previous_response_id)
    truncation: str = "disabled"
    user: str | None = None
    background: bool = False
