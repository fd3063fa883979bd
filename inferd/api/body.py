"""A request's JSON body, read once: a 400 for anything that is not one bounded JSON object."""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from inferd.api.edge import read_body
from inferd.api.errors import bad_request
from inferd.api.offload import OFFLOAD
from inferd.api.state import SETTINGS


def _reject_constant(name: str) -> None:
    raise ValueError(f"invalid JSON: {name} is not a number")


MAX_JSON_DEPTH = 64  # nested arrays and objects in a request body
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # (a pair is fine; half of one is not)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (NaN / Infinity refused, nesting bounded); errors become 400s."""
    body = await read_body(request, request.app[SETTINGS].server.body_timeout_seconds)
    return await request.app[OFFLOAD].run(len(body), lambda: parse_json(body))


def parse_json(body: bytes) -> dict[str, Any]:
    """`read_json`'s parse and checks (on a worker thread for a big body)."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:  # deeper than the parser's own stack allows
        raise bad_request(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the constants above
        raise bad_request(f"invalid JSON in the request body: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    if _depth_exceeds(data, MAX_JSON_DEPTH):
        raise bad_request(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
    if SURROGATE_ESCAPE.search(body) and _has_lone_surrogate(data):
        # NOTE: JSON may escape half of a UTF-16 pair alone ("\ud800"); Python keeps it in the
        # string, which is then no text at all: no tokenizer or encoder downstream takes it
        raise bad_request("the request body has a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair): "
                          "not Unicode text")
    return data


def _has_lone_surrogate(data: Any) -> bool:
    """Whether a string (a key or a value) anywhere in `data` holds a lone surrogate."""
    stack = [data]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            for text in (key, value):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        return True
            if isinstance(value, dict | list):
                stack.append(value)
    return False


def _depth_exceeds(data: Any, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit` (iteratively: no recursion to overflow)."""
    level = [data]
    for _ in range(limit):
        level = [child for node in level
                 for child in (node.values() if isinstance(node, dict) else node if isinstance(node, list) else ())
                 if isinstance(child, dict | list)]
        if not level:
            return False
    return True
