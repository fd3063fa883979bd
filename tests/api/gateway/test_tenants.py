"""The keyring: keys to principals by digest, whatever the digests' first bytes share."""

from __future__ import annotations

import hashlib

from inferd.api.gateway.ratelimit import RateLimits
from inferd.api.gateway.tenants import ANONYMOUS, Keyring, Principal, Tenant
from inferd.settings.config import Settings


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_build_resolves_tenant_admin_and_plain_keys() -> None:
    settings = Settings.model_validate({
        "server": {"admin_key_sha256": [sha("sk-admin")]},
        "tenants": {"acme": {"key_sha256": [sha("sk-a1"), sha("sk-a2").upper()], "weight": 3, "tier": "paid",
                             "requests_per_second": 2, "classes": ["batch"], "models": ["m"]}},
    })
    keyring = Keyring.build(settings, frozenset({sha("sk-plain")}))
    assert keyring.num_keys == 4 and not keyring.open
    acme = keyring.tenants["acme"]
    assert acme == Tenant("acme", "paid", 3.0, RateLimits(2.0, None, None, None), frozenset({"batch"}), None,
                          frozenset({"m"}), "tenant:acme")
    assert keyring.lookup("sk-a1") == keyring.lookup("sk-a2") == Principal(acme)
    assert keyring.lookup("sk-admin") == Principal(admin=True)
    assert keyring.lookup("sk-plain") is ANONYMOUS
    assert keyring.lookup("sk-a3") is None and keyring.lookup("") is None
    assert Keyring.build(Settings()).open


def test_digests_sharing_the_index_prefix_each_resolve_to_their_own() -> None:
    given = hashlib.sha256(b"sk-real").digest()
    twin = given[:8] + bytes(24)  # the same index bucket, another digest
    a, b = Principal(admin=True), ANONYMOUS
    keyring = Keyring({}, {twin: b, given: a})
    assert keyring.lookup("sk-real") is a
    assert Keyring({}, {twin: b}).lookup("sk-real") is None
