"""The session a generation request names, whatever its protocol: the `x-session-id` header on
any generation path, else the key its body gives (OpenAI's `prompt_cache_key`) or its protocol
derives (Anthropic's cache_control: anthropic/cache.py). The door scopes it to the tenant and
settles its TTL (admission/door.py); the engine keeps its newest prefix cached between turns.

A key the client itself sent (the header, or the body's field) goes back in the response's
x-session-id header (SESSION_ECHO, read by app.py), so that a router in front can pin the
session to this replica; a derived key is inferd's own and never leaves it.
"""

from __future__ import annotations

from aiohttp import web

from inferd.api.admission.ask import SessionAsk
from inferd.api.errors import bad_request
from inferd.api.record import echoable

SESSION_HEADER = "x-session-id"
MAX_KEY_CHARS = 256
SESSION_ECHO = web.RequestKey("session_echo", str)  # the key the response echoes in x-session-id


def asked_session(request: web.Request, key: str | None = None, param: str = "prompt_cache_key",
                  ttl: float | None = None, derived: bool = False) -> SessionAsk | None:
    """The session `request` names: its x-session-id header (a blank one is no header), else
    `key` (the body's field `param`, or with `derived` a key inferd made); `ttl` as asked (None:
    the server's). A key over MAX_KEY_CHARS characters, or an empty one, is a 400 naming where it
    came from. A key the client sent is echoed where it is fit for a header (record.echoable)."""
    header = request.headers.get(SESSION_HEADER, "").strip()
    if header:
        ask = SessionAsk(checked_key(header, SESSION_HEADER), ttl)
    elif key is not None:
        ask = SessionAsk(checked_key(key, param), ttl)
    else:
        return None
    echo = echoable(ask.key, MAX_KEY_CHARS) if header or not derived else None
    if echo is not None:
        request[SESSION_ECHO] = echo
    return ask


def checked_key(key: str, param: str) -> str:
    if not 1 <= len(key) <= MAX_KEY_CHARS:
        raise bad_request(f"a session key has 1 to {MAX_KEY_CHARS} characters, got {len(key)}", param=param)
    return key
