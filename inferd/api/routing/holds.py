"""Holding a model: every use of a model's engine from the API (a generation, a pooling request,
tokenize and detokenize, a token count) first holds its serving revision, and an unload or a
sleep waits until nobody does (llama.cpp freed a vocabulary under running tokenize calls once).

    acquire(request, model, caller)   where it goes (registry.pick) -> wait until it serves
                                      (lifecycle.serving: a load, a wake, room) -> hold it -> the
                                      ladder's steps -> Choice
    hold_engine(request, model)       the same for a tokenizer's user: the engine, held
    hold_middleware                   every hold a request took ends when its handler returns

A stream outlives its hold only when it runs on detached (a background response, a resumable
stream whose client left): the engine's open requests count it then, and an unload waits for
those too.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from inferd.api.routing.lifecycle import serving
from inferd.api.routing.registry import REGISTRY, Choice, ModelRegistry, ModelSlot
from inferd.api.routing.routes import Caller
from inferd.api.routing.served import Served
from inferd.engine.async_engine import AsyncEngine

HOLDS = web.RequestKey("model_holds", list)  # (slot, revision) pairs this request holds


async def acquire(request: web.Request, requested: str, caller: Caller) -> Choice:
    """Where a request for `requested` goes, its model serving and held until the handler
    returns (404 for a name nobody serves; 503 while it loads or sleeps too long, or the ladder
    refuses the caller's class there; 422 if its load failed)."""
    registry = request.app[REGISTRY]
    slot, route, fallback_from = registry.pick(requested, caller)
    served = await hold(request, registry, slot)
    ceiling, whole = slot.ladder_steps(served, caller.class_name)
    return Choice(slot, served, route, fallback_from, ceiling, whole)


async def hold_engine(request: web.Request, model: str | None) -> AsyncEngine:
    """The engine of the model (or alias) named, else the first model's, serving and held."""
    registry = request.app[REGISTRY]
    slot = registry.primary if model is None else registry.slot(model)
    return (await hold(request, registry, slot)).engine


async def hold(request: web.Request, registry: ModelRegistry, slot: ModelSlot) -> Served:
    served = await serving(registry, slot)
    served.holders += 1  # (no await since `serving` saw it serve: an unload that starts now waits for this)
    holds = request.get(HOLDS)
    if holds is None:
        request[HOLDS] = holds = []
    holds.append((slot, served))
    return served


def release(request: web.Request) -> None:
    """End every hold the request took."""
    holds = request.pop(HOLDS, None)
    if not holds:
        return
    now = time.monotonic()
    for slot, served in holds:
        served.holders -= 1
        slot.life.last_used = now
    request.app[REGISTRY].changes.notify()


@web.middleware
async def hold_middleware(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    finally:
        release(request)
