"""Tools of a type a protocol does not run: refused by name, or dropped where the operator says so."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from aiohttp import web

from inferd.api.errors import bad_request
from inferd.api.state import SETTINGS

DROPPED_TOOLS = web.RequestKey("dropped_tools", str)  # the x-inferd-dropped-tools header: their types

T = TypeVar("T")


def supported_tools(request: web.Request, tools: Sequence[T], kind: Callable[[T], str | None],
                    runs: Callable[[str | None], bool], param: str = "tools") -> list[T]:
    """The tools the protocol runs. The others are a 400 naming their types and the setting, or,
    with `[server] unsupported_tools = "drop"`, left out and named in x-inferd-dropped-tools."""
    unsupported = [t for t in tools if not runs(kind(t))]
    if not unsupported:
        return list(tools)
    names = ", ".join(sorted({str(kind(t)) for t in unsupported}))
    if request.app[SETTINGS].server.unsupported_tools == "reject":
        raise bad_request(f"tool type {names} is not supported here (function tools only); set [server] "
                          'unsupported_tools = "drop" to leave such tools out', param=param, code="unsupported_tool")
    request[DROPPED_TOOLS] = names
    return [t for t in tools if runs(kind(t))]
