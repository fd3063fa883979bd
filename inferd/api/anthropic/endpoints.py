"""The Anthropic protocol's endpoints, and its error shape on them.

    POST /v1/messages               messages.py (`?beta=true`, as Claude Code sends it, is the same)
    POST /v1/messages/count_tokens  messages.py
"""

from __future__ import annotations

from aiohttp import web

from inferd.api.anthropic.errors import error_response
from inferd.api.anthropic.messages import count_tokens, create_message
from inferd.api.errors import ERROR_SHAPES

PREFIX = "/v1/messages"


def add_anthropic_endpoints(app: web.Application) -> None:
    app.router.add_post(PREFIX, create_message)
    app.router.add_post(f"{PREFIX}/count_tokens", count_tokens)
    app.setdefault(ERROR_SHAPES, []).append((PREFIX, error_response))
