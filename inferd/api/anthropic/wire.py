"""Anthropic's Messages API as pydantic models: the request (validated once, here) and the reply.

Strict like the OpenAI models (an unknown field is a 400 naming it), with one difference: the
fields Anthropic's clients send as hints that ask for nothing inferd must do are accepted and
ignored, by name (HINTS). Content blocks inferd cannot read (image, document, a server tool's
results) are a 400 naming the block; so is a server tool (`type` other than "custom").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from inferd.api.wire import PromptCacheUsage, RequestModel, ResponseModel, refuse_media

# Sent by Claude Code and the SDK, and meaningless here: a service tier, beta context editing,
# output effort, MCP servers and containers (which only Anthropic's platform runs), cache-miss
# diagnostics, the platform's user and workspace ids. Accepted, ignored. Cache breakpoints
# (cache_control) are read only as a request for a session (cache.py): the prefix cache finds
# shared prefixes by itself.
HINTS = ("cache_control", "service_tier", "context_management", "output_config", "container", "mcp_servers",
         "inference_geo", "diagnostics", "user_profile_id", "workspace_id")


class CacheHinted(RequestModel):
    cache_control: dict[str, Any] | None = None  # a prompt-cache breakpoint: asks for a session (cache.py)


class TextBlock(CacheHinted):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(CacheHinted):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(CacheHinted):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]


class Message(RequestModel):
    # "system" inside messages: Claude Code sends one; read as a system turn
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    _media = field_validator("content", mode="before")(refuse_media)


class Tool(CacheHinted):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # None or "custom"; a server tool ("web_search_20250305", "bash_...", which run on Anthropic's
    # platform) is refused or dropped by conversation/tool_policy.py
    type: str | None = None
    defer_loading: bool | None = None  # tool search's hint: every tool is in the prompt here

    model_config = ConfigDict(strict=True, extra="allow")  # a server tool's own fields (max_uses, ...)

    @model_validator(mode="after")
    def _a_custom_tool(self) -> Tool:
        if self.custom and self.input_schema is None:
            raise ValueError(f"tool {self.name!r} needs an input_schema")
        if self.custom and self.model_extra:
            raise ValueError(f"unknown field {sorted(self.model_extra)[0]!r} in tool {self.name!r}")
        return self

    @property
    def custom(self) -> bool:
        return self.type in (None, "custom")

    def as_function(self) -> dict[str, Any]:
        """As an OpenAI function tool: what the prompt's tool format and the grammars read."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is set with type "tool", and only then')
        return self


class Thinking(RequestModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class Metadata(RequestModel):
    user_id: str | None = None


class Prompted(RequestModel):
    """What makes the prompt: shared by a messages request and a count_tokens one."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # accepted hints (HINTS)
    context_management: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and (self.tool_choice is None or self.tool_choice.type != "none")

    def system_text(self) -> str:
        if self.system is None or isinstance(self.system, str):
            return self.system or ""
        return "\n\n".join(block.text for block in self.system)


class MessagesRequest(Prompted):
    max_tokens: int = Field(ge=1)  # required, as Anthropic's; over the server's limit it is clamped
    stop_sequences: list[str] | None = Field(default=None, max_length=4)
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    # accepted hints (HINTS); temperature, top_p and top_k are not in the 2026 SDK's signature,
    # but older clients send them (and extra_body does)
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None
    output_config: dict[str, Any] | None = None
    container: Any = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class CountTokensRequest(Prompted):
    """POST /v1/messages/count_tokens: the prompt part of a messages request."""


# ------------------------------------------------------------------------------ replies


class MessageUsage(ResponseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0  # prompt tokens the prefix cache served
    cache_creation_input_tokens: int = 0  # (inferd caches every prompt as it goes: no separate write)
    # inferd's extension (as OpenAI's usage has it): why the prefix cache served no more
    prompt_cache: PromptCacheUsage | None = Field(default=None, exclude_if=lambda value: value is None)


class TextOut(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(ResponseModel):
    """A thinking model's reasoning. inferd signs nothing: `signature` is empty, and a thinking
    block sent back is taken whatever its signature."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseOut(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal", "pause_turn"]


class MessageResponse(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(ResponseModel):
    input_tokens: int


class AnthropicError(ResponseModel):
    type: str
    message: str


class AnthropicErrorResponse(ResponseModel):
    type: Literal["error"] = "error"
    error: AnthropicError
