"""The JSON bodies' base models every protocol package builds on, and the error body.

Requests are strict (no "10" for 10, no true for 1) and an unknown field is a 400 that names it;
replies are documented in /openapi.json from the same models. The error body is OpenAI's shape,
which errors.py renders for every path but the Anthropic one.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class RequestModel(BaseModel):
    """A request body or part of one: strict, and an unknown field is a 400."""

    model_config = ConfigDict(strict=True, extra="forbid")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorDetail


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)
