"""The JSON bodies' base models every protocol package builds on, and the error body.

Requests are strict (no "10" for 10, no true for 1) and an unknown field is a 400 that names it;
replies are documented in /openapi.json from the same models. The error body is OpenAI's shape,
which errors.py renders for every path but the Anthropic one.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# content parts that are no text: every model inferd serves reads text only (a multimodal
# checkpoint, Qwen3.5's, runs as its language model without the vision tower)
MEDIA_PARTS = ("image", "image_url", "input_image", "input_audio", "audio", "video", "video_url", "file", "input_file")


class RequestModel(BaseModel):
    """A request body or part of one: strict, and an unknown field is a 400."""

    model_config = ConfigDict(strict=True, extra="forbid")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptCacheUsage(ResponseModel):
    """inferd's usage extension on every generation (each prompt's first choice, summed): how much
    of the prompt the prefix cache served, and why not more."""

    cached_tokens: int  # prompt tokens the prefix cache served
    host_tokens: int  # of which came back from the host-memory tier (cache.kv_host_cache_memory)
    # why it served less than the prompt's cacheable part ("evicted", "diverged at token N",
    # "another tenant's namespace", "volatile block", "cold"); null: a full hit
    miss: str | None
    # prompt blocks dropped as volatile (cache.volatile_prompt_patterns); absent: none
    volatile_blocks: int | None = Field(default=None, exclude_if=lambda value: value is None)


class ErrorDetail(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorDetail


def refuse_media(content: Any) -> Any:
    """A message content's validator (mode="before"): an image (audio, video, file) part is a 400
    that says why, rather than one that lists the part types a text part may have."""
    for part in content if isinstance(content, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise ValueError(f"{kind} content is not supported: inferd serves the model for text only (a "
                             "multimodal checkpoint runs without its vision tower)")
    return content


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)
