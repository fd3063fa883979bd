"""The tenants' side of the status page, and the admin endpoints (admin key only: auth.py).

    GET  /admin/tenants   every tenant's configuration (limits, classes, models; never keys)
                          and its status
    POST /admin/reload    re-read the keys and tenants, as SIGHUP does; a bad file is a 400
                          and the old ones keep serving

A tenant's key sees in /v1/status its own row and its own requests only; an admin key (or any
caller of a server with no keys) sees them all.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from inferd.api import status_protocol as s
from inferd.api.auth import principal_of
from inferd.api.errors import bad_request
from inferd.api.gateway import Gateway
from inferd.api.protocol import dump
from inferd.api.fleet import FLEET
from inferd.api.state import GATEWAY
from inferd.api.tenants import Principal
from inferd.config import SettingsError
from inferd.engine.protocol import EngineSnapshot

log = logging.getLogger(__name__)


def visible_tenant(principal: Principal) -> str | None:
    """The one tenant a caller may see (its own); None: it may see every tenant."""
    return None if principal.admin or principal.tenant is None else principal.tenant.name


def tenant_statuses(gateway: Gateway, snapshot: EngineSnapshot, only: str | None) -> list[s.TenantStatus]:
    engine_side = {t.name: t for t in snapshot.tenants}
    rows = []
    for name, tenant in gateway.keyring.tenants.items():
        if only is not None and name != only:
            continue
        account, limiter, fair = gateway.accounts[name], gateway.limiters[name], engine_side.get(name)
        rows.append(s.TenantStatus(
            name=name, tier=tenant.tier, weight=tenant.weight, requests=account.requests,
            prompt_tokens=account.prompt_tokens, completion_tokens=account.completion_tokens,
            rejections=dict(account.rejections), waiting=fair.waiting if fair else 0,
            running=fair.running if fair else 0, virtual_tokens=fair.virtual_tokens if fair else 0.0,
            ttft_p50_seconds=account.ttft.percentile(50), ttft_p95_seconds=account.ttft.percentile(95),
            tpot_p50_seconds=account.tpot.percentile(50), remaining_requests=limiter.remaining_requests,
            remaining_tokens=limiter.remaining_tokens,
        ))
    return rows


def _tenant_table(gateway: Gateway, snapshot: EngineSnapshot) -> list[dict[str, Any]]:
    statuses = {t.name: dump(t) for t in tenant_statuses(gateway, snapshot, None)}
    table = []
    for name, tenant in gateway.keyring.tenants.items():
        limits = tenant.limits
        table.append({
            "name": name, "tier": tenant.tier, "weight": tenant.weight,
            "classes": None if tenant.classes is None else sorted(tenant.classes),
            "default_class": tenant.default_class,
            "models": None if tenant.models is None else sorted(tenant.models),
            "limits": {"requests_per_second": limits.requests_per_second, "requests_burst": limits.requests_burst,
                       "tokens_per_second": limits.tokens_per_second, "tokens_burst": limits.tokens_burst},
            "status": statuses[name],
        })
    return table


async def list_tenants(request: web.Request) -> web.Response:
    gateway, engine = request.app[GATEWAY], request.app[FLEET].primary.current.engine
    return web.json_response({"object": "list", "data": _tenant_table(gateway, engine.snapshot)})


async def reload_keys(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    try:
        keyring = await gateway.reload()
    except (SettingsError, ValueError) as e:
        log.warning("reload refused (the old keys and tenants stay): %s", e)
        raise bad_request(f"reload refused, the old keys and tenants stay: {e}", code="invalid_settings") from None
    who = principal_of(request)
    log.info("keys reloaded by %s: %d keys, %d tenants", "an admin key" if who.admin else "a caller",
             keyring.num_keys, len(keyring.tenants))
    return web.json_response({"keys": keyring.num_keys, "tenants": sorted(keyring.tenants)})


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/tenants", list_tenants)
    app.router.add_post("/admin/reload", reload_keys)
