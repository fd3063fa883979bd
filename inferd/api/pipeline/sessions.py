"""The session a generation request names, whatever its protocol: the `x-session-id` header on
any generation path, else the key its body gives (OpenAI's `prompt_cache_key`) or its protocol
derives (Anthropic's cache_control: anthropic/cache.py). The door scopes it to the tenant and
settles its TTL (admission/door.py); the engine keeps its newest prefix cached between turns.
"""

from __future__ import annotations

from aiohttp import web

from inferd.api.admission.ask import SessionAsk
from inferd.api.errors import bad_request

SESSION_HEADER = "x-session-id"
MAX_KEY_CHARS = 256


def asked_session(request: web.Request, key: str | None = None, param: str = "prompt_cache_key",
                  ttl: float | None = None) -> SessionAsk | None:
    """The session `request` names: its x-session-id header (a blank one is no header), else
    `key` (the body's field `param`, or a derived key); `ttl` as asked (None: the server's).
    A key over MAX_KEY_CHARS characters, or an empty one, is a 400 naming where it came from."""
    header = request.headers.get(SESSION_HEADER, "").strip()
    if header:
        return SessionAsk(checked_key(header, SESSION_HEADER), ttl)
    if key is not None:
        return SessionAsk(checked_key(key, param), ttl)
    return None


def checked_key(key: str, param: str) -> str:
    if not 1 <= len(key) <= MAX_KEY_CHARS:
        raise bad_request(f"a session key has 1 to {MAX_KEY_CHARS} characters, got {len(key)}", param=param)
    return key
