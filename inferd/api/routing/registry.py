"""Several models in one process: each served name, the revision serving it, and where a
request's `model` goes.

    request.model --alias?--> name --route?--> rule / cascade / weighted sticky pick --> model
                                                       |
                          model degraded and it has a fallback? --> the fallback's slot
                                                       |
                     the functional ladder: this class refused (503)? max_tokens capped? whole?
                                                       |
                 slot.current: the revision serving it (engine, door, probe), once it serves:
                     a model on demand, or asleep, loads or wakes first (lifecycle.py, holds.py)

A slot holds one served name and the counters that outlive its revisions. A reload (reload.py)
loads the new revision beside the old one and swaps `current` only once it has passed its
probe and evaluation set; the old one keeps its in-flight requests, is retired once they have
ended, and is then freed (its engine stopped, its weights and KV pool dropped with the last
reference). Only the event loop reads or writes any of this; each engine's thread sees its own
requests only. (Replicas of a whole server behind HAProxy are docs/fleet.md's, not this.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from inferd.api.errors import APIError
from inferd.api.kv_events import KVEventPublisher, KVEventSink
from inferd.api.routing.life import Changes
from inferd.api.routing.routes import Caller, Cascade, Route, RouteRule
from inferd.api.routing.served import ModelSpec, Served
from inferd.api.routing.slot import ModelSlot
from inferd.api.state import ServerState
from inferd.engine.async_engine import AsyncEngine
from inferd.settings.config import Settings
from inferd.settings.models import RouteTable

log = logging.getLogger(__name__)

TICK_SECONDS = 1.0  # how often the degradation triggers look at each model

Loader = Callable[[ModelSpec], AsyncEngine]  # loads a revision (in a worker thread on reloads)


@dataclass
class Choice:
    """Where one request goes, and what the ladder changes for it there."""

    slot: ModelSlot
    served: Served
    route: Route | None = None
    fallback_from: str | None = None  # the model asked for, when its fallback answers
    ceiling: int | None = None  # the ladder's max_tokens ceiling
    whole: bool = False  # the ladder answers a stream in one piece

    @property
    def cascade(self) -> Cascade | None:
        return None if self.route is None else self.route.cascade


@dataclass
class ModelRegistry:
    """Every served name, its aliases and the routes; the primary is the first model (the one of a
    single-model server: /v1/status's top level and the unlabelled metrics describe it)."""

    server: ServerState
    slots: dict[str, ModelSlot]
    routes: dict[str, Route] = field(default_factory=dict)
    loader: Loader | None = None  # None: no reloads (a server built around one given engine)
    aliases: dict[str, str] = field(default_factory=dict)
    kv_events: KVEventPublisher | None = None  # each started engine's KV events go here (create_app sets it)
    settings: Settings | None = None  # what a revision loaded on demand serves with (None: no loads)
    models_max: int | None = None  # [server] models_max: unpinned models loaded at once (lifecycle.py)
    load_wait_seconds: float = 120.0  # [server] model_load_wait_seconds
    changes: Changes = field(default_factory=Changes)  # a slot's state changed, or a hold ended
    room: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load makes room at a time
    heartbeat: Callable[[], None] | None = None  # (the systemd watchdog) every engine started beats it

    def __post_init__(self) -> None:
        self.refresh_aliases()

    @property
    def primary(self) -> ModelSlot:
        return next(iter(self.slots.values()))

    @property
    def lead(self) -> ModelSlot | None:
        """What /v1/status's top level and the unlabelled metrics describe: the primary, else
        (models on demand) the first model with an engine; None while none has one."""
        return next((slot for slot in self.slots.values() if slot.engine_snapshot is not None), None)

    def refresh_aliases(self) -> None:
        self.aliases = {alias: slot.name for slot in self.slots.values() for alias in slot.latest_spec.aliases}

    def served(self) -> Iterator[Served]:
        """Every loaded revision: serving (or asleep at level 1, or unloading) and retiring."""
        for slot in self.slots.values():
            if slot.current is not None:
                yield slot.current
            yield from slot.retiring

    @property
    def open_requests(self) -> int:
        return sum(s.engine.open_requests for s in self.served())

    def names(self) -> list[str]:
        return [*self.slots, *self.aliases, *self.routes]

    def slot(self, name: str) -> ModelSlot:
        """The slot of a model name or alias; 404 model_not_found otherwise."""
        slot = self.slots.get(self.aliases.get(name, name))
        if slot is None:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.names()}",
                           param="model", code="model_not_found")
        return slot

    def pick(self, requested: str, caller: Caller) -> tuple[ModelSlot, Route | None, str | None]:
        """Where a request for `requested` goes: (slot, route, the model asked for when its
        fallback answers); 404 for a name nobody serves. holds.acquire then waits for the slot
        to serve, holds it and applies the ladder."""
        route = self.routes.get(requested)
        slot = self.slot(route.choose(caller) if route is not None else requested)
        fallback_from = None
        fallback = slot.latest_spec.fallback
        if slot.degradation.use_fallback and fallback is not None:
            target = self.slots[fallback]
            if not target.degradation.use_fallback:  # (never to a fallback that is itself degraded)
                slot.counts.fallbacks += 1
                slot, fallback_from = target, slot.name
        slot.counts.requests += 1
        return slot, route, fallback_from

    def tick(self, now: float) -> None:
        """Feed every serving model's degradation triggers and ladder one look at its engine."""
        for slot in self.slots.values():
            if (served := slot.serving) is None:
                continue  # (not loaded, asleep, or moving: nothing to look at)
            slot.degradation.update(now, served.signals())
            slot.ladder.update(now, slot.degradation.overloaded)

    async def watch(self) -> None:
        """The triggers' clock: a look a second, until cancelled."""
        while True:
            try:
                self.tick(time.monotonic())
            except Exception:  # (a bug here must not stop the clock for good)
                log.exception("degradation triggers: the look at the models failed")
            await asyncio.sleep(TICK_SECONDS)

    async def start(self) -> None:
        for served in self.served():
            await self.start_served(served)

    async def stop(self) -> None:
        moving = [t for slot in self.slots.values() if (t := slot.life.task) is not None]
        for task in moving:  # (a load or wake under way ends here; its engine, if started, stops)
            task.cancel()
        await asyncio.gather(*moving, return_exceptions=True)
        for served in list(self.served()):
            await self.stop_served(served)

    async def start_served(self, served: Served) -> None:
        """Start a revision's engine (and probe), its KV events going to the publisher: every
        path that starts one (start-up, a load on demand, a wake) comes through here (a reload's
        new revision starts without, and takes over the events with `hand_over_events`)."""
        self.attach_events(served)
        await served.start()

    async def stop_served(self, served: Served) -> None:
        """Stop a revision's engine; its cached blocks are gone: subscribers hear AllBlocksCleared
        (once: stopping it again, or a revision that publishes nothing, says nothing)."""
        await served.stop()
        self.detach_events(served)

    def attach_events(self, served: Served) -> None:
        """The revision's engine publishes its KV events from its next step (events on)."""
        if self.kv_events is not None:
            served.engine.kv_event_sink = self.kv_events.sink(served.spec.name, len(self.slots) > 1)

    def detach_events(self, served: Served) -> None:
        """The revision's engine publishes no more KV events; subscribers hear AllBlocksCleared
        for its model, after any batch it was handing over (KVEventSink.close)."""
        sink, served.engine.kv_event_sink = served.engine.kv_event_sink, None
        if isinstance(sink, KVEventSink) and self.kv_events is not None:
            sink.close()
            self.kv_events.cleared(served.spec.name, len(self.slots) > 1)

    def hand_over_events(self, old: Served, new: Served) -> None:
        """A reload's new revision takes over: the old one's events end with AllBlocksCleared, the
        new one's begin (its cache, filled by its probe and evaluation before, goes unannounced),
        so a router's index of the model never mixes revisions."""
        self.detach_events(old)
        self.attach_events(new)

    @property
    def probed(self) -> bool:
        """Every serving model's start-up probe has run (one not loaded yet is fine)."""
        return all(served.health.probed for slot in self.slots.values() if (served := slot.serving) is not None)

    def readiness(self) -> tuple[str, str | None]:
        """(state, reason): ready once every model has been probed, unless draining or a model
        that has no fallback fails its probe or its steps (one with a fallback is served by it)."""
        if self.server.draining:
            return "draining", None
        for slot in self.slots.values():
            served = slot.serving
            if served is None:  # (a model on demand not loaded, asleep, or loading: it answers when asked)
                continue
            if served.spec.fallback is not None and served.engine.alive:
                continue
            if served.health.probe_error is not None:
                return "not_ready", served.health.probe_error
            if not served.engine.alive:
                return "not_ready", f"the engine of {slot.name} stopped"
            if not served.engine.snapshot.healthy:
                failed = served.engine.snapshot.consecutive_step_failures
                return "not_ready", (f"the engine failed {failed} steps in a row" if failed
                                     else "the engine failed steps in a row recently; recovering")
        return ("ready" if self.server.probed else "loading"), None


REGISTRY = web.AppKey("models", ModelRegistry)


# ------------------------------------------------------------------------------ building


POOLING_KEYS = ("task", "pooling", "normalize", "embeddings")  # [models.NAME] keys over [model]'s


def model_specs(settings: Settings) -> list[ModelSpec]:
    """The [models.NAME] tables in file order, or else the one model of [model] (its name is the
    setting, else filled in from the loaded file by `served_name`)."""
    if not settings.models:
        return [ModelSpec(name=settings.model.name or "", path=settings.model.path)]
    return [ModelSpec(name=name, revision=t.revision, path=t.path, aliases=t.aliases, dtype=t.dtype,
                      kv_cache_memory=t.kv_cache_memory, fallback=t.fallback, eval_file=t.eval_file,
                      pooling={k: v for k in POOLING_KEYS if (v := getattr(t, k)) is not None},
                      load=t.load, pinned=t.pinned, idle_unload_seconds=t.idle_unload_seconds)
            for name, t in settings.models.items()]


def served_name(settings: Settings, model_path: str) -> str:
    """The single model's name clients send: the setting, else the file's stem or the folder's name."""
    if settings.model.name:
        return settings.model.name
    path = Path(model_path)
    return path.stem if path.is_file() else path.name


def build_routes(tables: dict[str, RouteTable]) -> dict[str, Route]:
    routes = {}
    for name, t in tables.items():
        rules = tuple(RouteRule(r.model, frozenset(r.classes), frozenset(r.tenants), frozenset(r.tiers))
                      for r in t.rules)
        if t.kind == "cascade":
            assert t.small is not None and t.large is not None  # (the settings check)
            routes[name] = Route(name, {t.small: 1.0}, rules, Cascade(t.small, t.large, t.threshold, t.measure))
        else:
            targets = t.targets or {rules[0].target: 1.0}  # (rules only: the first rule's model otherwise)
            routes[name] = Route(name, targets, rules)
    return routes


def single_model(engine: AsyncEngine, settings: Settings, loader: Loader | None = None) -> ModelRegistry:
    """A registry of the one engine given (tests, and `inferd serve` without [models] tables)."""
    name = served_name(settings, engine.limits.model_path)
    server = ServerState(name)
    spec = ModelSpec(name=name, path=settings.model.path)
    slot = ModelSlot(spec, Served(spec, engine, server, settings), settings.degradation)
    return ModelRegistry(server, {name: slot}, loader=loader, settings=settings)


def load_models(settings: Settings, loader: Loader) -> ModelRegistry:
    """Load every model of the settings loaded at start ([models.NAME] load = "start"), one after
    the other, in their order; those loaded on demand wait for their first request."""
    specs = model_specs(settings)
    if not settings.models:
        return single_model(loader(specs[0]), settings, loader)
    models_max = settings.server.models_max
    at_start = [spec.name for spec in specs if spec.load == "start" and not spec.pinned]
    if models_max is not None and len(at_start) > models_max:
        raise ValueError(f"[server] models_max = {models_max}, but {len(at_start)} unpinned models load at start "
                         f"({', '.join(at_start)}): raise it, pin some, or load some on demand")
    server = ServerState(specs[0].name)
    slots = {}
    for spec in specs:
        served = None
        if spec.load == "start":
            log.info("loading model %s revision %s from %s", spec.name, spec.revision, spec.path or "the embedded file")
            served = Served(spec, loader(spec), server, settings)
        slots[spec.name] = ModelSlot(spec, served, settings.degradation)
    return ModelRegistry(server, slots, build_routes(settings.routes), loader, settings=settings,
                         models_max=models_max, load_wait_seconds=settings.server.model_load_wait_seconds)
