"""Several models in one process: each served name, the revision serving it, and where a
request's `model` goes.

    request.model --alias?--> name --route?--> rule / cascade / weighted sticky pick --> model
                                                       |
                          model degraded and it has a fallback? --> the fallback's slot
                                                       |
                     the functional ladder: this class refused (503)? max_tokens capped? whole?
                                                       |
                                   slot.current: the revision serving it (engine, door, probe)

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

from inferd.api.admission.door import DoorCounts
from inferd.api.errors import APIError
from inferd.api.routing.degradation import FunctionalDegradation, ModelDegradation, Triggers
from inferd.api.routing.routes import Caller, Cascade, Route, RouteRule
from inferd.api.routing.served import ModelSpec, Served
from inferd.api.state import ServerState
from inferd.engine.async_engine import AsyncEngine
from inferd.settings.config import Settings
from inferd.settings.models import DegradationSettings, RouteTable

log = logging.getLogger(__name__)

TICK_SECONDS = 1.0  # how often the degradation triggers look at each model
POLL_SECONDS = 0.05  # how often a retiring revision looks again

Loader = Callable[[ModelSpec], AsyncEngine]  # loads a revision (in a worker thread on reloads)


@dataclass
class ModelCounts:
    """One served name's counters, for /metrics and /v1/status: they outlive its revisions."""

    requests: int = 0  # requests sent to it (by name, alias, route, or as a fallback), admitted or not
    fallbacks: int = 0  # requests for it sent to its fallback while it was degraded
    reloads: int = 0  # revisions that took over
    reloads_refused: int = 0  # revisions discarded (load, probe or evaluation failed)
    escalations: int = 0  # cascade: answers of this (small) model found unsure, asked again
    tokens_saved: int = 0  # cascade: tokens the large model did not compute (the small answer sufficed)
    door: DoorCounts = field(default_factory=DoorCounts)  # refusals and grammars at every revision's door
    # pooling requests answered (/v1/embeddings: "embed"; /v1/rerank and /v1/score: "score"), by task:
    # requests, their inputs (texts or pairs) and those inputs' prompt tokens
    pooling: dict[str, PoolingCounts] = field(default_factory=lambda: {task: PoolingCounts() for task in POOLING_TASKS})


POOLING_TASKS = ("embed", "score")


@dataclass
class PoolingCounts:
    requests: int = 0
    inputs: int = 0
    prompt_tokens: int = 0

    def add(self, inputs: int, prompt_tokens: int) -> None:
        self.requests += 1
        self.inputs += inputs
        self.prompt_tokens += prompt_tokens


class ModelSlot:
    """One served name: the revision serving it now, the one before (for a rollback), the
    revisions retiring (draining their in-flight requests), its degradation and its counts."""

    def __init__(self, served: Served, degradation: DegradationSettings) -> None:
        self.current = served
        self.previous: ModelSpec | None = None
        self.retiring: list[Served] = []
        self.settings = degradation
        self.degradation = ModelDegradation(triggers(degradation))
        self.ladder = FunctionalDegradation(degradation.hold_seconds, degradation.recover_seconds)
        self.counts = ModelCounts(door=served.door.counts)
        self.lock = asyncio.Lock()  # one reload at a time

    @property
    def name(self) -> str:
        return self.current.spec.name

    def retire(self, old: Served) -> None:
        """`old` keeps its in-flight requests; once they have ended its engine stops."""
        self.retiring.append(old)
        asyncio.ensure_future(self._retire(old))

    async def _retire(self, old: Served) -> None:
        while old.engine.open_requests:
            await asyncio.sleep(POLL_SECONDS)
        await old.stop()
        self.retiring.remove(old)
        log.info("model %s: revision %s retired", self.name, old.spec.revision)

    def ladder_steps(self, class_name: str) -> tuple[int | None, bool]:
        """(max_tokens ceiling, answered whole) for a request of the class, as the functional
        ladder stands; 503 while the class is refused."""
        d, ladder = self.settings, self.ladder
        if class_name not in d.classes or ladder.level == 0:
            return None, False
        ranks = {c.name: i for i, c in enumerate(self.current.door.limits.policy.ranked)}  # best first
        lowest = max(d.classes, key=lambda name: ranks.get(name, -1))
        if ladder.refuses(class_name, lowest):
            raise APIError(503, f"model {self.name} is overloaded: class {class_name!r} is refused for now "
                                f"(degradation level {ladder.name})", code="degraded",
                           headers={"Retry-After": str(max(1, round(d.recover_seconds)))})
        return (d.max_tokens_ceiling if ladder.level >= 2 else None), ladder.stream_whole()


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

    def __post_init__(self) -> None:
        self.refresh_aliases()

    @property
    def primary(self) -> ModelSlot:
        return next(iter(self.slots.values()))

    def refresh_aliases(self) -> None:
        self.aliases = {alias: slot.name for slot in self.slots.values() for alias in slot.current.spec.aliases}

    def served(self) -> Iterator[Served]:
        """Every loaded revision: serving and retiring."""
        for slot in self.slots.values():
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

    def choose(self, requested: str, caller: Caller) -> Choice:
        """Where a request for `requested` goes (404 for a name nobody serves; 503 while the
        ladder refuses the caller's class there)."""
        route = self.routes.get(requested)
        slot = self.slot(route.choose(caller) if route is not None else requested)
        fallback_from = None
        fallback = slot.current.spec.fallback
        if slot.degradation.use_fallback and fallback is not None:
            target = self.slots[fallback]
            if not target.degradation.use_fallback:  # (never to a fallback that is itself degraded)
                slot.counts.fallbacks += 1
                slot, fallback_from = target, slot.name
        slot.counts.requests += 1
        ceiling, whole = slot.ladder_steps(caller.class_name)
        return Choice(slot, slot.current, route, fallback_from, ceiling, whole)

    def tick(self, now: float) -> None:
        """Feed every model's degradation triggers and ladder one look at its engine."""
        for slot in self.slots.values():
            slot.degradation.update(now, slot.current.signals())
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
            await served.start()

    async def stop(self) -> None:
        for served in list(self.served()):
            await served.stop()

    @property
    def probed(self) -> bool:
        return all(slot.current.health.probed for slot in self.slots.values())

    def readiness(self) -> tuple[str, str | None]:
        """(state, reason): ready once every model has been probed, unless draining or a model
        that has no fallback fails its probe or its steps (one with a fallback is served by it)."""
        if self.server.draining:
            return "draining", None
        for slot in self.slots.values():
            served = slot.current
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
                      pooling={k: v for k in POOLING_KEYS if (v := getattr(t, k)) is not None})
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
    slot = ModelSlot(Served(spec, engine, server, settings), settings.degradation)
    return ModelRegistry(server, {name: slot}, loader=loader)


def load_models(settings: Settings, loader: Loader) -> ModelRegistry:
    """Load every model of the settings, one after the other, in their order."""
    specs = model_specs(settings)
    if not settings.models:
        return single_model(loader(specs[0]), settings, loader)
    server = ServerState(specs[0].name)
    slots = {}
    for spec in specs:
        log.info("loading model %s revision %s from %s", spec.name, spec.revision, spec.path or "the embedded file")
        slots[spec.name] = ModelSlot(Served(spec, loader(spec), server, settings), settings.degradation)
    return ModelRegistry(server, slots, build_routes(settings.routes), loader)


def triggers(d: DegradationSettings) -> Triggers:
    return Triggers(queue_p95_seconds=d.queue_p95_seconds, preemptions_per_minute=d.preemptions_per_minute,
                    ooms_per_minute=d.ooms_per_minute, hold_seconds=d.hold_seconds, recover_seconds=d.recover_seconds)
