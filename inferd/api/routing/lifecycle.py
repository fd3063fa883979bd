"""Models on demand, unloads, sleep and wake: every move of a slot from one state to the next
(life.py draws the states; holds.py is how a request waits for one and holds it).

    a request for a model that is not serving (`serving`), waiting at most
    [server] model_load_wait_seconds, then 503 model_loading / model_asleep with a Retry-After:
        unloaded, failed  -> `start_load`: loading, in a task of its own (a waiter that leaves does
                             not stop it) -> room first ([server] models_max: the least recently
                             used idle unpinned model unloads; none idle: wait) -> the file in a
                             worker thread -> started, probed -> serving
                             (it fails: failed, its waiters get 422 model_load_failed and the
                             reason; the next request tries again)
        loading, waking, unloading -> wait for it;   asleep -> wait for an admin's wake
    `begin_unload` (idle_unload_seconds, or room for another model): unloading (new holds wait) ->
        its holders and requests end -> its engine stops -> dropped: its weights and KV cache go
    `sleep` 1: as an unload, but the weights stay: only the KV cache goes (AsyncEngine.sleep)
            2: as an unload, but asleep: requests wait for the wake instead of loading it
    `wake`  1: the KV cache built again (AsyncEngine.wake), a new door over it, started, probed
            2: a load (room first)

Pinned models are not counted in models_max and never unloaded but by a sleep. Each slot moves
one step at a time (its lock also keeps reloads out); each step sets its state before it awaits
anything, so a state seen is a state in force.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time

from inferd.api.errors import APIError
from inferd.api.routing.life import SlotState
from inferd.api.routing.registry import ModelRegistry, ModelSlot
from inferd.api.routing.served import Served
from inferd.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

PROBE_SECONDS = 60.0  # a revision loaded on demand whose start-up probe has not run by then failed to load
RETRY_AFTER_SECONDS = 5  # a 503's Retry-After when nothing better is known
IDLE_TICK_SECONDS = 1.0  # how often the idle watcher looks (more often for shorter idle_unload_seconds)
MOVING = (SlotState.LOADING, SlotState.WAKING, SlotState.UNLOADING)


class NoRoom(Exception):
    """models_max models are loaded and none became idle in time."""


def occupies(slot: ModelSlot) -> bool:
    """Counted in models_max: an unpinned model whose weights are in memory (serving, unloading,
    asleep at level 1) or whose load has found its room."""
    return not slot.pinned and (slot.current is not None or slot.life.reserved)


def evictable(slot: ModelSlot) -> bool:
    """Unloaded to make room: unpinned, serving and idle (no hold, no request), or asleep at level 1."""
    if slot.pinned or slot.current is None:
        return False
    state = slot.life.state
    return (state is SlotState.SERVING and slot.current.idle) or (state is SlotState.ASLEEP and slot.life.level == 1)


# ------------------------------------------------------------------------------ waiting


async def serving(registry: ModelRegistry, slot: ModelSlot) -> Served:
    """The slot's serving revision, once it serves: a load started (or joined), a wake or room
    waited for, for at most [server] model_load_wait_seconds; 503 then, 422 if the load waited
    for failed, 503 once the server drains."""
    served = slot.serving
    if served is not None:
        return served
    life = slot.life
    life.counts.load_waits += 1
    deadline, attempt = time.monotonic() + registry.load_wait_seconds, None
    while (served := slot.serving) is None:
        if registry.server.draining:
            raise APIError(503, "the server is shutting down: no model loads now", code="draining",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        if life.state in (SlotState.UNLOADED, SlotState.FAILED):
            if life.state is SlotState.FAILED and attempt == life.attempt:
                raise load_failed(slot)
            attempt = start_load(registry, slot)
        elif attempt is None and life.state in (SlotState.LOADING, SlotState.WAKING):
            attempt = life.attempt  # (a load or wake under way: its outcome is this request's)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            life.counts.load_wait_timeouts += 1
            raise not_serving(registry, slot)
        await registry.changes.wait(remaining)
    return served


def not_serving(registry: ModelRegistry, slot: ModelSlot) -> APIError:
    """503 for a request that waited model_load_wait_seconds for the slot in vain."""
    life, waited = slot.life, registry.load_wait_seconds
    if life.state is SlotState.ASLEEP:
        return APIError(503, f"model {slot.name} is asleep (level {life.level}) and was not woken within {waited:g} s: "
                             f"it answers once an admin wakes it", param="model", code="model_asleep",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if life.state is SlotState.LOADING and not life.reserved and registry.models_max is not None:
        why = f"it waits for room: [server] models_max = {registry.models_max} models are loaded and none is idle"
    else:
        why = f"it is {life.state} (for {time.monotonic() - life.since:.0f} s)"
    expected = max(life.counts.load_seconds - (time.monotonic() - life.since), 1.0)
    return APIError(503, f"model {slot.name} did not serve within {waited:g} s: {why}; try again", param="model",
                    code="model_loading", headers={"Retry-After": str(round(expected))})


def load_failed(slot: ModelSlot) -> APIError:
    """The model's load failed (a bad file, too little memory, a failed probe): not the server's
    fault, nor fixed by retrying at once: 422, the reason named."""
    return APIError(422, f"model {slot.name} failed to load: {slot.life.error}", param="model",
                    code="model_load_failed")


# ------------------------------------------------------------------------------ loading


def start_load(registry: ModelRegistry, slot: ModelSlot, state: SlotState = SlotState.LOADING) -> int:
    """Load the slot's spec in a task of its own (loading, or waking from level 2); the attempt's number."""
    if registry.loader is None or registry.settings is None:
        raise APIError(503, f"model {slot.name} is not loaded, and this server cannot load models", code="model_loading",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    life = slot.life
    life.move(state)
    life.attempt += 1
    life.error = None
    life.task = asyncio.ensure_future(_load(registry, slot, waking=state is SlotState.WAKING))
    registry.changes.notify()
    return life.attempt


async def _load(registry: ModelRegistry, slot: ModelSlot, waking: bool) -> None:
    life, spec, started = slot.life, slot.spec, time.monotonic()
    assert registry.loader is not None
    log.info("model %s: loading revision %s from %s (%s)", slot.name, spec.revision, spec.path or "the embedded file",
             "a wake" if waking else "on demand")
    try:
        async with slot.lock:
            switched = await make_room(registry, slot, started + registry.load_wait_seconds)
            started = time.monotonic()  # (the load's own seconds from here: room may have taken some)
            engine = await asyncio.get_running_loop().run_in_executor(None, registry.loader, spec)
            slot.current = await _bring_up(registry, slot, engine)
    except NoRoom as e:  # (not the model's fault: the next request tries again)
        life.move(SlotState.ASLEEP if waking else SlotState.UNLOADED, 2 if waking else 0)
        log.warning("model %s: not loaded: %s", slot.name, e)
        return
    except Exception as e:  # noqa: BLE001 - a bad file, memory, a torch error, a failed probe: all the same here
        life.counts.load_failures += 1
        life.error = str(e) or type(e).__name__
        life.move(SlotState.FAILED)
        log.error("model %s: revision %s failed to load: %s", slot.name, spec.revision, life.error)
        return
    finally:
        life.reserved, life.task = False, None
        registry.changes.notify()
    life.counts.load_seconds = time.monotonic() - started
    life.counts.loads += 1
    life.counts.switches += switched
    life.counts.wakes += waking
    life.last_used = time.monotonic()
    life.move(SlotState.SERVING)
    registry.refresh_aliases()
    registry.changes.notify()
    log.info("model %s: revision %s serves, loaded in %.1f s%s", slot.name, spec.revision, life.counts.load_seconds,
             " (another model unloaded to make room)" if switched else "")
    await trim_heap()  # (what the load made and dropped on the way)


async def _bring_up(registry: ModelRegistry, slot: ModelSlot, engine: AsyncEngine,
                    probed: list[int] | None = None) -> Served:
    """A revision over a loaded (or woken) engine: a door of its own, started, its probe run (or,
    over weights already `probed`, their tokens carried over: a level-1 wake computes nothing)."""
    assert registry.settings is not None
    served = Served(slot.spec, engine, registry.server, registry.settings, slot.counts.door)
    served.engine.heartbeat = registry.heartbeat
    if probed is not None:
        served.probe.expected, served.health.probed = probed, True
    await registry.start_served(served)
    try:
        deadline = time.monotonic() + PROBE_SECONDS
        while not served.health.probed:
            if not served.engine.alive or time.monotonic() > deadline:
                raise RuntimeError(f"its inference probe did not run within {PROBE_SECONDS:.0f} s"
                                   if served.engine.alive else "its engine stopped before its inference probe ran")
            await asyncio.sleep(0.02)
    except BaseException:
        await registry.stop_served(served)
        raise
    slot.limits = served.engine.limits
    return served


async def make_room(registry: ModelRegistry, slot: ModelSlot, deadline: float) -> bool:
    """Room for the slot's model under models_max (a pinned one needs none): while the limit is
    reached, the least recently used evictable model unloads; none evictable: wait for one, until
    `deadline` (NoRoom). True if another model was unloaded for it."""
    if registry.models_max is None or slot.pinned:
        return False
    try:
        await asyncio.wait_for(registry.room.acquire(), max(deadline - time.monotonic(), 0.001))
    except TimeoutError:
        raise NoRoom("another load is still making room") from None
    switched = False
    try:
        while True:
            others = [s for s in registry.slots.values() if s is not slot and occupies(s)]
            if len(others) < registry.models_max:
                slot.life.reserved = True
                return switched
            victim = min(filter(evictable, others), key=lambda s: s.life.last_used, default=None)
            if victim is not None:
                await begin_unload(registry, victim, f"to make room for {slot.name}")
                switched = True
            elif time.monotonic() >= deadline:
                raise NoRoom(f"[server] models_max = {registry.models_max} models are loaded ("
                             f"{', '.join(s.name for s in others)}) and none became idle")
            else:
                await registry.changes.wait(deadline - time.monotonic())
    finally:
        registry.room.release()


# ---------------------------------------------------------------------------- unloading


def begin_unload(registry: ModelRegistry, slot: ModelSlot, why: str) -> asyncio.Task[None]:
    """Unload the slot's revision (serving, or asleep at level 1: then it stays asleep, at level 2):
    unloading at once (new requests wait), the rest in a task."""
    level = 2 if slot.life.state is SlotState.ASLEEP else 0
    slot.life.move(SlotState.UNLOADING)
    registry.changes.notify()
    return asyncio.ensure_future(_unload(registry, slot, why, level))


async def _unload(registry: ModelRegistry, slot: ModelSlot, why: str, level: int) -> None:
    started = time.monotonic()
    async with slot.lock:
        await _stop(registry, slot)
        slot.current = None
        slot.forget_degradation()
        slot.life.counts.unloads += 1
        slot.life.move(SlotState.ASLEEP if level else SlotState.UNLOADED, level)
    registry.changes.notify()
    # NOTE: no gc.collect() (it would hold the GIL ~0.1 s, every stream's pause): no cycle holds the
    # weights or the KV cache (a test checks it), so they went with the last reference, now
    await trim_heap()
    log.info("model %s: unloaded %s (%.1f s)", slot.name, why, time.monotonic() - started)


async def _stop(registry: ModelRegistry, slot: ModelSlot) -> Served:
    """Once nobody holds the slot's revision and no request of its runs: its engine stopped."""
    served = slot.current
    assert served is not None
    while not served.idle:
        await registry.changes.wait(registry.load_wait_seconds)
    await registry.stop_served(served)  # (a level-1 sleeper's again: a no-op)
    slot.spec = served.spec
    return served


# ------------------------------------------------------------------------ sleep and wake


async def settle(registry: ModelRegistry, slot: ModelSlot) -> None:
    """Until the slot is not loading, waking or unloading (bounded: 409 model_busy)."""
    deadline = time.monotonic() + registry.load_wait_seconds
    while slot.life.state in MOVING:
        if time.monotonic() > deadline:
            raise APIError(409, f"model {slot.name} is still {slot.life.state}: try again", code="model_busy")
        await registry.changes.wait(deadline - time.monotonic())


async def sleep(registry: ModelRegistry, slot: ModelSlot, level: int) -> int | None:
    """Put the model to sleep (module docstring); the KV cache's bytes freed at level 1. Requests
    it holds finish first; new ones wait for the wake."""
    if level == 2 and registry.loader is None:
        raise APIError(409, f"this server cannot load model {slot.name} again once its weights are freed: "
                            f"sleep at level 1", param="level", code="sleep_level_unavailable")
    await settle(registry, slot)
    life = slot.life
    if life.state is SlotState.ASLEEP and (life.level >= level or slot.current is None):
        return None
    if life.state is SlotState.ASLEEP or slot.current is None:  # (1 -> 2; or not loaded: nothing to free)
        if slot.current is not None:
            await begin_unload(registry, slot, "(asleep, level 2)")
        life.move(SlotState.ASLEEP, 2)
        registry.changes.notify()
        return None
    life.move(SlotState.UNLOADING)
    registry.changes.notify()
    freed = None
    try:
        async with slot.lock:
            served = await _stop(registry, slot)
            if level == 1:
                freed = await served.engine.sleep()
            else:
                slot.current = None
            life.counts.sleeps += 1
    finally:
        life.move(SlotState.ASLEEP, level)
        registry.changes.notify()
    await trim_heap()
    log.info("model %s: asleep, level %d%s", slot.name, level,
             f" ({freed / 2**20:.0f} MiB of KV cache freed)" if freed is not None else " (weights freed)")
    return freed


async def wake(registry: ModelRegistry, slot: ModelSlot) -> None:
    """Wake the model (module docstring), or load one not loaded; until it serves or failed."""
    await settle(registry, slot)
    life = slot.life
    if life.state is SlotState.ASLEEP and slot.current is not None:
        life.move(SlotState.WAKING)
        life.attempt += 1
        registry.changes.notify()
        life.task = asyncio.ensure_future(_wake_kv(registry, slot))
    elif life.state is SlotState.ASLEEP:
        start_load(registry, slot, SlotState.WAKING)
    elif life.state in (SlotState.UNLOADED, SlotState.FAILED):
        start_load(registry, slot)
    while life.state in MOVING:
        await registry.changes.wait(registry.load_wait_seconds)


async def _wake_kv(registry: ModelRegistry, slot: ModelSlot) -> None:
    life, asleep, started = slot.life, slot.current, time.monotonic()
    assert asleep is not None
    try:
        async with slot.lock:
            await asleep.engine.wake()
            slot.current = await _bring_up(registry, slot, asleep.engine, asleep.probe.expected)
    except Exception as e:  # noqa: BLE001 - e.g. no memory for the KV cache now: it stays asleep
        life.error = f"{type(e).__name__}: {e}"
        life.move(SlotState.ASLEEP, 1)
        log.error("model %s: the wake failed, it stays asleep: %s", slot.name, life.error)
        return
    finally:
        life.task = None
        registry.changes.notify()
    life.counts.wakes += 1
    life.counts.load_seconds = time.monotonic() - started
    life.last_used = time.monotonic()
    life.move(SlotState.SERVING)
    registry.changes.notify()
    log.info("model %s: awake (its KV cache built again in %.2f s)", slot.name, life.counts.load_seconds)


async def trim_heap() -> None:
    """Give the heap a dropped model left free back to the system (glibc keeps it otherwise, and a
    model unloaded would still count in the process's resident memory: ~0.5 GB per SmolLM2 load on
    CPU, measured), in a thread of its own at the lowest CPU priority, the GIL released.

    NOTE: the lowest priority, because handing ~0.5 GB of pages back is ~25 ms of the kernel's
    time: at the default priority it took a core from the other models' steps (a 2.8-step pause
    of their streams on 2 cores, measured; at the lowest, within the quiet windows' pauses)."""
    if _MALLOC_TRIM is None:
        return
    done = asyncio.get_running_loop().create_future()

    def trim() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # (Linux: this thread alone)
            _MALLOC_TRIM(0)
        finally:
            done.get_loop().call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    threading.Thread(target=trim, name="inferd-trim", daemon=True).start()
    await done


try:
    _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim  # (glibc's; None elsewhere)
except (OSError, AttributeError):
    _MALLOC_TRIM = None


# ------------------------------------------------------------------------------ idle


def idle_expired(slot: ModelSlot, now: float) -> bool:
    """Serving, unpinned, idle, and neither used nor (re)loaded for its idle_unload_seconds."""
    limit = slot.idle_unload_seconds
    if limit is None or slot.pinned or slot.life.state is not SlotState.SERVING or slot.current is None:
        return False
    return slot.current.idle and now - max(slot.life.last_used, slot.life.since) >= limit


async def watch_idle(registry: ModelRegistry) -> None:
    """Unload each unpinned model idle for its idle_unload_seconds; until cancelled."""
    unloads: set[asyncio.Task[None]] = set()  # (held, so none is collected half-way)
    while True:
        now = time.monotonic()
        limits = [s.idle_unload_seconds for s in registry.slots.values() if s.idle_unload_seconds is not None]
        tick = min([IDLE_TICK_SECONDS, *(limit / 4 for limit in limits)])
        for slot in registry.slots.values():
            if idle_expired(slot, now):
                task = begin_unload(registry, slot, f"after {slot.idle_unload_seconds:g} s idle")
                unloads.add(task)
                task.add_done_callback(unloads.discard)
        await asyncio.sleep(tick)
