"""Who is calling: API keys resolved to a principal (a tenant, an admin, or a plain key).

    Authorization: Bearer KEY -> SHA-256 -> Keyring -> Principal(tenant, admin)

Keys are held as SHA-256 digests only ([tenants.NAME] key_sha256, server.admin_key_sha256,
server.api_keys_file, and --api-key / INFERD_API_KEYS hashed at start). A lookup finds the
candidates by the digest's first 8 bytes, then compares whole digests in constant time: what
the lookup's timing could tell is whether SHA-256 of a guess shares 8 bytes with a stored
digest, which says nothing about any key. So the cost stays flat with 1,000 tenants, where
comparing against every digest would cost ~100 µs a request.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from inferd.api.gateway.ratelimit import RateLimits
from inferd.settings.config import Settings, TenantSettings

_PREFIX = 8  # bytes of the digest the index is keyed by


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant's configuration, as the gateway applies it (never its keys)."""

    name: str
    tier: str
    weight: float
    limits: RateLimits
    classes: frozenset[str] | None  # None: every class
    default_class: str | None
    models: frozenset[str] | None  # None: every model and route
    cache_scope: str  # whose prefix-cache blocks it may share: "tenant:NAME", or "group:NAME"
    speculative_history: bool = False  # its requests draft from its recent outputs too

    @classmethod
    def from_settings(cls, name: str, t: TenantSettings) -> Tenant:
        return cls(name=name, tier=t.tier, weight=t.weight,
                   limits=RateLimits(t.requests_per_second, t.requests_burst, t.tokens_per_second, t.tokens_burst),
                   classes=None if t.classes is None else frozenset(t.classes), default_class=t.default_class,
                   models=None if t.models is None else frozenset(t.models),
                   cache_scope=f"tenant:{name}" if t.cache_group is None else f"group:{t.cache_group}",
                   speculative_history=t.speculative_history)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request comes from: a tenant's key, an admin key, or a plain key (neither)."""

    tenant: Tenant | None = None
    admin: bool = False


ANONYMOUS = Principal()  # a plain key (server.api_keys_file, --api-key), or any caller of an open server
OPEN = Principal(admin=True)  # any caller of a server with no keys at all (a local, trusted set-up)


class Keyring:
    """Key digests -> principals, and the tenants by name."""

    def __init__(self, tenants: dict[str, Tenant], digests: dict[bytes, Principal]) -> None:
        self.tenants = tenants
        self._index: dict[bytes, list[tuple[bytes, Principal]]] = {}
        for d, principal in digests.items():
            self._index.setdefault(d[:_PREFIX], []).append((d, principal))
        self.num_keys = len(digests)

    @classmethod
    def build(cls, settings: Settings, plain_digests: frozenset[str] = frozenset()) -> Keyring:
        """From the settings' tenants and admin keys, and the plain keys' digests (hex)."""
        tenants = {name: Tenant.from_settings(name, t) for name, t in settings.tenants.items()}
        digests = {bytes.fromhex(d): ANONYMOUS for d in plain_digests}
        digests |= {bytes.fromhex(d): Principal(admin=True) for d in settings.server.admin_key_sha256}
        for name, t in settings.tenants.items():
            digests |= {bytes.fromhex(d): Principal(tenants[name]) for d in t.key_sha256}
        return cls(tenants, digests)

    @property
    def open(self) -> bool:
        """No key at all is configured: every caller is let in."""
        return self.num_keys == 0

    def lookup(self, key: str) -> Principal | None:
        return self.lookup_digest(hashlib.sha256(key.encode()).digest())

    def lookup_digest(self, given: bytes) -> Principal | None:
        """The principal of a key given by its SHA-256 digest (32 bytes), or None."""
        found = None
        for stored, principal in self._index.get(given[:_PREFIX], ()):
            if hmac.compare_digest(stored, given):
                found = principal
        return found
