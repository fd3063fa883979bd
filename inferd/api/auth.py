"""API keys: stored and compared as SHA-256 digests, never logged.

Keys come from --api-key and INFERD_API_KEYS (in the clear, hashed here) and from
server.api_keys_file (one hex digest per line, `#` comments). With no keys the server is open.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from aiohttp import web
from aiohttp.typedefs import Middleware

from inferd.api.errors import APIError, Handler
from inferd.config import SettingsError

_DIGEST = re.compile(r"[0-9a-fA-F]{64}")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_api_keys(cli_keys: list[str], env_value: str | None, keys_file: str | None) -> frozenset[str]:
    """The SHA-256 hex digests of every accepted key; SettingsError for a bad keys file."""
    digests = {digest(k.strip()) for k in cli_keys if k.strip()}
    digests |= {digest(k.strip()) for k in (env_value or "").split(",") if k.strip()}
    if keys_file is not None:
        try:
            with open(keys_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise SettingsError(f"server.api_keys_file: cannot read {keys_file} ({reason})") from None
        for number, line in enumerate(lines, 1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            if not _DIGEST.fullmatch(entry):
                # NOTE: the line is not echoed: it may be a key pasted in the clear
                raise SettingsError(
                    f"server.api_keys_file: {keys_file} line {number} is not a SHA-256 hex digest "
                    "(64 hex characters; make one with `printf %s KEY | sha256sum`)"
                )
            digests.add(entry.lower())
    return frozenset(digests)


def auth_middleware(digests: frozenset[str], open_paths: tuple[str, ...]) -> Middleware:
    """Require `Authorization: Bearer KEY` with a known digest on every path but `open_paths`."""
    stored = tuple(bytes.fromhex(d) for d in digests)
    free = frozenset(open_paths)

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in free:
            return await handler(request)
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise _unauthorized("missing API key: send `Authorization: Bearer KEY`")
        given = hashlib.sha256(key.encode()).digest()
        # compare against every stored digest, always, in constant time each
        matched = False
        for d in stored:
            matched |= hmac.compare_digest(d, given)
        if not matched:
            raise _unauthorized("invalid API key")
        return await handler(request)

    return check_key


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
