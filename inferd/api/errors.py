"""The one place where errors become HTTP responses, in OpenAI's shape unless a protocol
registered its own for its paths (ERROR_SHAPES: Anthropic's for /v1/messages):

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Handlers raise `APIError` (or let a domain error through: pydantic's ValidationError, a JSON
decode error, the engine's EngineDeadError); `error_middleware` renders them. The engine's
aborts, failures and timeouts become errors here too.
Anything else is a bug: a 500 in the same shape, logged with its traceback.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import ValidationError

from inferd.engine.protocol import ERROR_CODES, EngineDeadError, EngineOutput

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5
_TYPES = {401: "authentication_error", 503: "service_unavailable"}
# pydantic's union-member and validator tags in an error location ("str", "list[int]", ...)
_TAG = re.compile(r".*[\[\]].*|str|int|float|bool|none")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status) or ("server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers
        self.close = close  # end the connection after the response (the body may be left unread)

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        response = web.json_response(self.body(), status=self.status, headers=self.headers)
        if self.close:
            response.force_close()
        return response


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_abort_error(out: EngineOutput) -> APIError:
    """An abort the engine made (shutdown, engine failure): the request could not finish."""
    reason = out.stop_reason if isinstance(out.stop_reason, str) else "the request was aborted"
    return APIError(503, f"generation stopped: {reason}", code="service_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def engine_failure_error(out: EngineOutput) -> APIError:
    """A request the engine failed (finish_reason "error"): 400 when its grammar could not go on
    (the client's to change), 500 when its own processing raised, 503 with a Retry-After when its
    step's forward failed or it did not fit in memory."""
    code = out.error or "internal_error"
    if code == "invalid_grammar":
        return APIError(400, f"the request's grammar could not go on: {out.stop_reason}", code=code)
    if not ERROR_CODES.get(code, False):
        return APIError(500, f"internal error while generating: {out.stop_reason}", type="server_error", code=code)
    return APIError(503, f"generation failed: {out.stop_reason}; retry", code=code, headers={"Retry-After": "1"})


TIMEOUT_MESSAGES = {
    "queue": "waited longer than its queue timeout to be scheduled",
    "ttft": "got no first token within its TTFT timeout",
    "token": "waited longer than its per-token timeout for the next token",
    "total": "ran longer than its total timeout",
}


def timeout_error(out: EngineOutput) -> APIError:
    """The error that names which timeout ended a request (an SSE event, or the 503 of a
    non-streaming request that timed out before its first token)."""
    kind = str(out.stop_reason)
    return APIError(503, f"the request {TIMEOUT_MESSAGES.get(kind, 'timed out')}", type="timeout_error",
                    code=f"{kind}_timeout", headers={"Retry-After": "1"})


def from_validation_error(e: ValidationError) -> APIError:
    """400 naming the offending field as a dotted path ("messages.0.role").

    A union reports one error per member; `param` is the path they share, and an error whose
    path is a prefix of another's (a string was expected, a list came) is left out of the text.
    """
    paths = [
        tuple(str(part) for part in err["loc"] if not (isinstance(part, str) and _TAG.fullmatch(part)))
        for err in e.errors(include_url=False)
    ]
    shared = paths[0]
    for path in paths[1:]:
        shared = tuple(a for a, b in itertools.takewhile(lambda ab: ab[0] == ab[1], zip(shared, path)))
    messages: list[str] = []
    for path, err in zip(paths, e.errors(include_url=False)):
        if any(len(other) > len(path) and other[: len(path)] == path for other in paths):
            continue
        reason = {"value_error": lambda: str(err["ctx"]["error"]),
                  "extra_forbidden": lambda: "unknown field"}.get(err["type"], lambda: err["msg"])()
        text = f"{'.'.join(path)}: {reason}" if path else reason
        if text not in messages:
            messages.append(text)
    more = f" (and {len(messages) - 3} more)" if len(messages) > 3 else ""
    return bad_request("; ".join(messages[:3]) + more, param=".".join(shared) or None)


def to_api_error(e: BaseException) -> APIError:
    """The HTTP form of any exception a handler let through."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValidationError):
        return from_validation_error(e)
    if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
        return bad_request(f"invalid JSON in the request body: {e}")
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the model is not available: {e}", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, web.HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status)
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return APIError(e.status, e.reason if e.status == 405 else (e.text or e.reason), code=code, headers=headers)
    return APIError(500, "internal server error", type="server_error")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# (path prefix, renderer): a protocol whose errors have their own shape (Anthropic's) names its
# paths here at start-up; every other path answers in OpenAI's
ERROR_SHAPES = web.AppKey("error_shapes", list[tuple[str, Callable[[APIError], web.Response]]])


def error_response(request: web.Request, error: APIError) -> web.Response:
    """`error` in the shape of the protocol `request.path` belongs to."""
    for prefix, render in request.app.get(ERROR_SHAPES, ()):
        if request.path.startswith(prefix):
            return render(error)
    return error.response()


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        error = to_api_error(e)
        if e.status == 404:
            error.message = f"no such path: {request.method} {request.path}"
        elif e.status == 405:
            error.message = f"method {request.method} is not allowed on {request.path}"
    except Exception as e:  # noqa: BLE001 - every error leaves in its protocol's shape
        error = to_api_error(e)
        if error.status >= 500 and not isinstance(e, (APIError, EngineDeadError)):
            log.exception("unhandled error in %s %s", request.method, request.path)
    return error_response(request, error)
