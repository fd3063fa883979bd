"""Errors in Anthropic's shape, for its paths: `{"type": "error", "error": {"type", "message"}}`.

The shared stages raise the same `APIError` for every protocol; here it takes Anthropic's status
codes and types: overload is 529 `overloaded_error` (a 503 elsewhere), a timeout 504
`timeout_error`, each with its Retry-After. The field at fault is named in the message, as
Anthropic's shape has no `param`.
"""

from __future__ import annotations

from aiohttp import web

from inferd.api.errors import APIError
from inferd.api.streaming.sse import Dialect, Named
from inferd.api.wire import dump
from inferd.api.anthropic.wire import AnthropicError, AnthropicErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
          504: "timeout_error", 529: "overloaded_error"}


def status_of(error: APIError) -> int:
    if error.status == 503:
        return 504 if error.type == "timeout_error" else 529
    return error.status


def body_of(error: APIError) -> dict:
    status = status_of(error)
    kind = _TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return dump(AnthropicErrorResponse(error=AnthropicError(type=kind, message=message)))


def error_response(error: APIError) -> web.Response:
    response = web.json_response(body_of(error), status=status_of(error), headers=error.headers)
    if error.close:
        response.force_close()
    return response


def error_event(error: APIError) -> Named:
    """An error once the stream has begun (the status line is out): Anthropic's `error` event."""
    return Named("error", body_of(error))


DIALECT = Dialect(error_event, end="")  # no `data: [DONE]`: message_stop ends the stream
