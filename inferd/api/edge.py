"""The HTTP edge, kept as a careful proxy (nginx) keeps it: what is refused before any handler
reads the body, and how long a connection may hold the server without sending anything.

    a credential header given twice (Authorization, x-api-key)   400 duplicate_header
    a declared Content-Length over the body cap                   413 body_too_large, from the header
    a body (chunked or not) still arriving after
      server.body_timeout_seconds                                 408 body_timeout
    an idle keep-alive connection, or a request head still
      arriving, after server.idle_timeout_seconds                 closed (aiohttp's keep-alive timer)

Each refusal closes the connection (what is left of the body is never read) and is counted in
/metrics as inferd_http_refusals{reason}.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from inferd.api.errors import APIError, Handler
from inferd.settings.config import ServerSettings

MAX_BODY_BYTES = 32 * 2**20  # a batch of long token-id prompts is large JSON
CREDENTIAL_HEADERS = ("Authorization", "x-api-key")
REFUSALS = ("duplicate_header", "body_too_large", "body_timeout")


@dataclass
class EdgeCounts:
    """Requests the edge refused, by why (the keys of REFUSALS)."""

    refused: Counter[str] = field(default_factory=Counter)


EDGE = web.AppKey("edge", EdgeCounts)


def connection_options(server: ServerSettings) -> dict[str, Any]:
    """The aiohttp runner's per-connection limits (`inferd serve` and the tests' servers alike)."""
    # NOTE: aiohttp's keep-alive timer runs from the connection's start and again after each
    # response, and closes only a connection with no request being handled: so it bounds both an
    # idle keep-alive connection and a request head sent a line at a time (slowloris).
    return {"keepalive_timeout": server.idle_timeout_seconds}


def edge_middleware(max_body_bytes: int) -> Middleware:
    """Refuse a repeated credential header and a declared body over `max_body_bytes` at once."""

    @web.middleware
    async def check_edge(request: web.Request, handler: Handler) -> web.StreamResponse:
        for name in CREDENTIAL_HEADERS:
            if len(request.headers.getall(name, ())) > 1:
                raise refuse(request, 400, f"the {name} header may appear once; it appears "
                             f"{len(request.headers.getall(name))} times", "duplicate_header")
        declared = request.content_length
        if declared is not None and declared > max_body_bytes:
            raise refuse(request, 413, f"the request body ({declared} bytes) is over the {max_body_bytes}-byte "
                         "limit", "body_too_large")
        return await handler(request)

    return check_edge


async def read_body(request: web.Request, timeout: float) -> bytes:
    """The whole body, within `timeout` seconds of the handler asking for it (408 past it)."""
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise refuse(request, 408, f"the request body did not arrive within {timeout:g} s "
                     "(server.body_timeout_seconds)", "body_timeout") from None
    except web.HTTPRequestEntityTooLarge:  # a chunked body past the cap (no length declared)
        raise refuse(request, 413, f"the request body is over the {MAX_BODY_BYTES}-byte limit",
                     "body_too_large") from None


def refuse(request: web.Request, status: int, message: str, code: str) -> APIError:
    """The refusal, counted; its response closes the connection."""
    request.app[EDGE].refused[code] += 1
    return APIError(status, message, code=code, close=True)
