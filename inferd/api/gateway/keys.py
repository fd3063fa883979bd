"""API keys: stored and compared as SHA-256 digests, never logged.

Plain keys come from --api-key and INFERD_API_KEYS (in the clear, hashed here) and from
server.api_keys_file (one hex digest per line, `#` comments); tenants' and admin keys from the
settings (tenants.py). With no keys at all the server is open.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from inferd.api.errors import APIError, Handler
from inferd.api.record import RECORD
from inferd.api.gateway.tenants import ANONYMOUS, OPEN, Keyring, Principal
from inferd.settings.values import DIGEST_HINT, SHA256_HEX, SettingsError, read_lines

PRINCIPAL = web.RequestKey("principal", Principal)
KEY_DIGEST = web.RequestKey("key_digest", str)  # the caller's key (hex SHA-256): who owns a resumable stream



def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_api_keys(cli_keys: list[str], env_value: str | None, keys_file: str | None) -> frozenset[str]:
    """The SHA-256 hex digests of every accepted key; SettingsError for a bad keys file."""
    digests = {digest(k.strip()) for k in cli_keys if k.strip()}
    digests |= {digest(k.strip()) for k in (env_value or "").split(",") if k.strip()}
    if keys_file is not None:
        for number, line in enumerate(read_lines(keys_file, "server.api_keys_file"), 1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            if not SHA256_HEX.fullmatch(entry):
                # NOTE: the line is not echoed: it may be a key pasted in the clear
                raise SettingsError(
                    f"server.api_keys_file: {keys_file} line {number} is not a SHA-256 hex digest ({DIGEST_HINT})"
                )
            digests.add(entry.lower())
    return frozenset(digests)


def auth_middleware(keyring: Callable[[], Keyring], open_paths: tuple[str, ...],
                    status_admin_only: bool = False) -> Middleware:
    """Resolve `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) to its principal
    (request[PRINCIPAL]) on every path but `open_paths`: a 401 for a missing or unknown key, a
    403 for a path the key may not use (/admin/* and, with `status_admin_only`, /v1/status need an
    admin key). The keyring is read per request, so a reload takes effect at once."""
    free = frozenset(open_paths)

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in free:
            return await handler(request)
        keys = keyring()
        if keys.open:
            request[PRINCIPAL] = OPEN
            return await handler(request)
        key = key_of(request)
        if not key:
            raise _unauthorized("missing API key: send `Authorization: Bearer KEY` (or `x-api-key: KEY`)")
        given = hashlib.sha256(key.encode()).digest()  # (hashed once: the lookup and the stream owner)
        principal = keys.lookup_digest(given)
        if principal is None:
            raise _unauthorized("invalid API key")
        if not principal.admin and (request.path.startswith("/admin/") or
                                    (status_admin_only and request.path == "/v1/status")):
            raise APIError(403, f"{request.path} needs an admin key", type="permission_error",
                           code="admin_key_required")
        request[PRINCIPAL] = principal
        request[KEY_DIGEST] = given.hex()
        record = request.get(RECORD)
        if record is not None and principal.tenant is not None:
            record.tenant = principal.tenant.name  # (its log line names it, refused or not)
        return await handler(request)

    return check_key


def key_of(request: web.Request) -> str:
    """The key a request carries: `Authorization: Bearer KEY`, else `x-api-key` (what Anthropic's
    clients send); "" if neither."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return request.headers.get("x-api-key", "").strip()


def principal_of(request: web.Request) -> Principal:
    """The caller (an open path's caller is anonymous)."""
    return request.get(PRINCIPAL, ANONYMOUS)


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
