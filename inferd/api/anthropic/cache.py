"""Anthropic's prompt caching as inferd reads it. A request that carries any `cache_control` (on
a system block, a message's block, a tool, or the top-level field) asks for its conversation's
prefix to be kept: a session (pipeline/sessions.py), keyed by the x-session-id header if given,
else `metadata.user_id` (where Claude Code puts its session id), else a hash of the system text
and the first message (the same in every later turn of a conversation); its TTL the largest
cache_control `ttl` ("5m", "1h"), else the server's. Volatile blocks (conversation/volatile.py)
are dropped from `system` and the messages' text first, so the hash never sees them.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from aiohttp import web

from inferd.api.admission.ask import SessionAsk
from inferd.api.anthropic.wire import Prompted, TextBlock, ToolResultBlock
from inferd.api.conversation.volatile import VolatileBlocks
from inferd.api.errors import bad_request
from inferd.api.pipeline.sessions import MAX_KEY_CHARS, asked_session

_TTL = re.compile(r"([1-9][0-9]{0,5})([smh])")
_UNIT = {"s": 1, "m": 60, "h": 3600}


def cache_controls(body: Prompted) -> list[dict[str, Any]]:
    """Every cache_control the request carries (tool results' text blocks' too)."""
    hinted: list[Any] = [body, *(body.tools or [])]
    if isinstance(body.system, list):
        hinted += body.system
    for message in body.messages:
        for block in message.content if isinstance(message.content, list) else ():
            hinted.append(block)
            if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                hinted += block.content
    return [control for h in hinted if (control := getattr(h, "cache_control", None)) is not None]


def asked_ttl(controls: list[dict[str, Any]]) -> float | None:
    """The largest `ttl` the cache_controls ask for, in seconds (None: none asks); a 400 for one
    that is no duration like "5m" or "1h"."""
    ttls = [_seconds(control["ttl"]) for control in controls if control.get("ttl") is not None]
    return max(ttls) if ttls else None


def _seconds(value: Any) -> float:
    match = _TTL.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise bad_request(f'cache_control.ttl must be a duration like "5m" or "1h", got {value!r}',
                          param="cache_control")
    return int(match[1]) * _UNIT[match[2]]


def session_of(request: web.Request, body: Prompted, controls: list[dict[str, Any]],
               user_id: str | None) -> SessionAsk | None:
    """The request's session: the header's key on any request; else, with any cache_control, the
    key derived from `user_id` or the conversation's start (read after volatile blocks are dropped)."""
    ttl = asked_ttl(controls)
    return asked_session(request, conversation_key(body, user_id) if controls else None, ttl=ttl, derived=True)


def conversation_key(body: Prompted, user_id: str | None) -> str:
    """metadata.user_id (its digest when it is longer than a key may be), else a digest of the
    system text and the first message, cache_control left out (its breakpoints move every turn)."""
    if user_id:
        return user_id if len(user_id) <= MAX_KEY_CHARS else hashlib.sha256(user_id.encode()).hexdigest()
    first = _without_cache_control(body.messages[0].model_dump(mode="json", exclude_none=True))
    text = json.dumps([body.system_text(), first], sort_keys=True, ensure_ascii=False)
    return "conversation:" + hashlib.sha256(text.encode()).hexdigest()


def _without_cache_control(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    return value


def drop_volatile(volatile: VolatileBlocks, body: Prompted) -> int:
    """Drop the volatile text of `system` and of the messages (their text blocks, or their whole
    text), before the prompt is rendered; how many blocks went. A system left empty is none."""
    dropped = 0
    body.system, dropped = volatile.strip(body.system, _text)
    if not body.system and body.system is not None and dropped:
        body.system = None
    for message in body.messages:
        message.content, n = volatile.strip(message.content, _text)
        dropped += n
    return dropped


def _text(block: Any) -> str | None:
    return block.text if isinstance(block, TextBlock) else None
