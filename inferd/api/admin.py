"""The admin endpoints (admin key only: gateway/keys.py).

    GET  /admin/tenants                 every tenant's configuration (limits, classes, models;
                                        never keys) and its status
    POST /admin/reload                  re-read the keys and tenants, as SIGHUP does; a bad file
                                        is a 400 and the old ones keep serving
    POST /admin/models/NAME/reload      a new revision beside the old one (routing/reload.py):
    POST /admin/models/NAME/rollback    it takes over once proved; or back to the previous one
                                        (a model not loaded: the revision it loads next)
    POST /admin/models/NAME/sleep       {"level"?: 1 | 2}: its KV cache freed (1), its weights too
    POST /admin/models/NAME/wake        (2); and back (routing/lifecycle.py); requests meanwhile wait
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from inferd.api.body import read_json
from inferd.api.errors import APIError, bad_request
from inferd.api.gateway.gate import GATEWAY, Gateway
from inferd.api.gateway.keys import principal_of
from inferd.api.routing.life import SlotState
from inferd.api.routing.lifecycle import load_failed, sleep, wake
from inferd.api.routing.registry import REGISTRY, ModelSlot
from inferd.api.routing.reload import RevisionRejected, reload_model
from inferd.api.routing.served import ModelSpec, Served
from inferd.api.state import STATE
from inferd.api.telemetry.status import engine_snapshots, tenant_statuses
from inferd.api.wire import dump
from inferd.settings.values import SettingsError

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------- tenants


def _tenant_table(gateway: Gateway, statuses: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
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
    gateway = request.app[GATEWAY]
    rows = tenant_statuses(gateway, engine_snapshots(request.app[REGISTRY]), None)
    return web.json_response({"object": "list", "data": _tenant_table(gateway, {t.name: dump(t) for t in rows})})


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


# ------------------------------------------------------------------------------- models


class ReloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None  # a new file or folder; None: the current one, read again
    revision: str | None = None  # None: the current revision's name


def _slot(request: web.Request) -> ModelSlot:
    name = request.match_info["name"]
    registry = request.app[REGISTRY]
    slot = registry.slots.get(name)
    if slot is None:
        raise APIError(404, f"no model {name!r}; the models are {list(registry.slots)}", param="name",
                       code="model_not_found")
    return slot


def _revision(served: Served, reloaded: bool) -> dict[str, Any]:
    spec = served.spec
    return {"model": spec.name, "revision": spec.revision, "path": served.engine.limits.model_path,
            "reloaded": reloaded}


async def reload_endpoint(request: web.Request) -> web.Response:
    slot = _slot(request)
    raw = await read_json(request) if request.can_read_body else {}
    try:
        body = ReloadBody.model_validate(raw)
    except ValueError as e:
        raise bad_request(f"invalid reload body: {e}") from None
    current = slot.latest_spec
    spec = dataclasses.replace(current, path=body.path or current.path, revision=body.revision or current.revision)
    if slot.current is None:  # (not loaded: the revision it loads when next asked or woken)
        slot.spec = spec
        path = spec.path or (slot.limits.model_path if slot.limits else "")
        return web.json_response({"model": spec.name, "revision": spec.revision, "path": path,
                                  "reloaded": False, "state": slot.life.state})
    return await _swap(request, slot, spec)


async def rollback_endpoint(request: web.Request) -> web.Response:
    slot = _slot(request)
    if slot.previous is None:
        raise APIError(409, f"model {slot.name} has no previous revision to return to", code="no_previous_revision")
    return await _swap(request, slot, slot.previous)


async def _swap(request: web.Request, slot: ModelSlot, spec: ModelSpec) -> web.Response:
    try:
        served = await reload_model(request.app[REGISTRY], request.app[STATE], slot, spec)
    except RevisionRejected as e:
        raise APIError(422, str(e), code="revision_rejected") from None
    return web.json_response(_revision(served, True))


class SleepBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    level: Literal[1, 2] = 1  # 1: the KV cache freed, the weights kept; 2: the weights freed too


async def sleep_endpoint(request: web.Request) -> web.Response:
    slot, started = _slot(request), time.monotonic()
    raw = await read_json(request) if request.can_read_body else {}
    try:
        body = SleepBody.model_validate(raw)
    except ValueError as e:
        raise bad_request(f"invalid sleep body: {e}", param="level") from None
    freed = await sleep(request.app[REGISTRY], slot, body.level)
    return web.json_response({"model": slot.name, "state": slot.life.state, "level": slot.life.level,
                              "seconds": round(time.monotonic() - started, 3), "kv_cache_bytes_freed": freed})


async def wake_endpoint(request: web.Request) -> web.Response:
    """200 once it serves; 422 if its load (or its KV cache's) failed, the reason named."""
    slot, started = _slot(request), time.monotonic()
    await wake(request.app[REGISTRY], slot)
    if slot.life.state is SlotState.FAILED:
        raise load_failed(slot)
    if slot.life.state is not SlotState.SERVING:
        raise APIError(422, f"model {slot.name} did not wake, it is {slot.life.state}: {slot.life.error}",
                       param="name", code="model_wake_failed")
    return web.json_response({"model": slot.name, "state": slot.life.state,
                              "seconds": round(time.monotonic() - started, 3)})


def add_admin_endpoints(app: web.Application) -> None:
    app.router.add_get("/admin/tenants", list_tenants)
    app.router.add_post("/admin/reload", reload_keys)
    app.router.add_post("/admin/models/{name}/reload", reload_endpoint)
    app.router.add_post("/admin/models/{name}/rollback", rollback_endpoint)
    app.router.add_post("/admin/models/{name}/sleep", sleep_endpoint)
    app.router.add_post("/admin/models/{name}/wake", wake_endpoint)
