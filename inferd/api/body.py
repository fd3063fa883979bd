"""A request's JSON body, read once: a 400 for anything that is not one bounded JSON object."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from inferd.api.errors import bad_request


def _reject_constant(name: str) -> None:
    raise ValueError(f"invalid JSON: {name} is not a number")


MAX_JSON_DEPTH = 64  # nested arrays and objects in a request body


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (NaN / Infinity refused, nesting bounded); errors become 400s."""
    body = await request.read()
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
    return data


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
