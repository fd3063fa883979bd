"""Several models in one process: each served name, the revision serving it, and where a
request's `model` goes.

    request.model --alias?--> name --route?--> rule / cascade / weighted sticky pick --> model
                                                       |
                          model degraded and it has a fallback? --> the fallback's slot
                                                       |
                                   slot.current: the revision serving it (engine, door, probe)

A slot holds one served name. A reload (reload.py) loads the new revision beside the old one
and swaps `current` only once it has passed its probe and evaluation set; the old one keeps
its in-flight requests, is retired once they have ended, and is then freed (its engine stopped,
its weights and KV pool dropped with the last reference). Only the event loop reads or writes
any of this; each engine's thread sees its own requests only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from inferd.api.degradation import FunctionalDegradation, ModelDegradation, Signals, Triggers
from inferd.api.door import FrontDoor
from inferd.api.errors import APIError
from inferd.api.logprobs import TokenTexts
from inferd.api.probe import InferenceProbe
from inferd.api.protocol import SamplingFields
from inferd.api.routing import Caller, Cascade, Route, RouteRule
from inferd.api.state import ModelHealth, ServerState
from inferd.config import Settings
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.policy import PriorityClass
from inferd.fleet_settings import RouteTable

log = logging.getLogger(__name__)

TICK_SECONDS = 1.0  # how often the degradation triggers look at each model
POLL_SECONDS = 0.05  # how often a retiring revision, or one waiting for its probe, looks again


@dataclass(frozen=True)
class ModelSpec:
    """What to load for a served name: one revision."""

    name: str
    revision: str = "1"
    path: str | None = None  # None: the embedded model
    aliases: tuple[str, ...] = ()
    dtype: str | None = None  # None: [model] dtype
    kv_cache_memory: float | None = None  # None: [cache] kv_cache_memory
    fallback: str | None = None
    eval_file: str | None = None

    @property
    def label(self) -> str:
        """The x-inferd-model header: which model and revision answered."""
        return f"{self.name}@{self.revision}"


Loader = Callable[[ModelSpec], AsyncEngine]  # loads a revision (in a worker thread on reloads)


def model_specs(settings: Settings) -> list[ModelSpec]:
    """The [models.NAME] tables in file order, or else the one model of [model] (its name is the
    setting, else filled in from the loaded file by `served_name`)."""
    if not settings.models:
        return [ModelSpec(name=settings.model.name or "", path=settings.model.path)]
    return [ModelSpec(name=name, revision=t.revision, path=t.path, aliases=t.aliases, dtype=t.dtype,
                      kv_cache_memory=t.kv_cache_memory, fallback=t.fallback, eval_file=t.eval_file)
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


class Served:
    """One loaded revision of a model: its engine, its door (admission, checks) and its probe."""

    def __init__(self, spec: ModelSpec, engine: AsyncEngine, server: ServerState, probe_interval: float) -> None:
        self.spec = spec
        self.engine = engine
        self.door = FrontDoor(engine)
        self.token_texts = TokenTexts(engine.tokenizer)
        self.health = ModelHealth()
        self.probe = InferenceProbe(engine, self.health, probe_interval, server)
        self._probing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """The engine thread, then the probe (start-up, then periodic) in a task of its own."""
        self.door.open()  # (a test's server may start over an engine another one drained)
        await self.engine.start()
        self._probing = asyncio.ensure_future(self.probe.run())

    async def first_probe(self, within: float) -> None:
        """Until the start-up probe (run by `start`'s task) has recorded its tokens; TimeoutError after `within`."""
        deadline = time.monotonic() + within
        while not self.health.probed:
            if time.monotonic() > deadline:
                raise TimeoutError(f"its inference probe did not run within {within:.0f} s")
            await asyncio.sleep(POLL_SECONDS)

    async def stop(self) -> None:
        if self._probing is not None:
            self._probing.cancel()
        await self.engine.stop()

    @property
    def healthy(self) -> bool:
        engine = self.engine
        return engine.alive and engine.snapshot.healthy and self.health.probe_error is None

    def signals(self) -> Signals:
        stats = self.engine.snapshot
        p95s = [c.queue_time_p95 for c in stats.classes if c.queue_time_p95 is not None]
        return Signals(healthy=self.healthy, queue_p95_seconds=max(p95s) if p95s else None,
                       preemptions_total=sum(stats.preemptions.values()), ooms_last_minute=stats.oom_events_last_minute)


@dataclass
class ModelCounts:
    """One served name's counters, for /metrics and /v1/status."""

    requests: int = 0  # requests sent to it (by name, alias, route, or as a fallback), admitted or not
    fallbacks: int = 0  # requests for it sent to its fallback while it was degraded
    reloads: int = 0  # revisions that took over
    reloads_refused: int = 0  # revisions discarded (load, probe or evaluation failed)
    escalations: int = 0  # cascade: answers of this (small) model found unsure, asked again
    tokens_saved: int = 0  # cascade: tokens the large model did not compute (the small answer sufficed)


class ModelSlot:
    """One served name: the revision serving it now, the one before (for a rollback), and the
    revisions retiring (draining their in-flight requests)."""

    def __init__(self, served: Served, triggers: Triggers) -> None:
        self.current = served
        self.previous: ModelSpec | None = None
        self.retiring: list[Served] = []
        self.degradation = ModelDegradation(triggers)
        self.ladder = FunctionalDegradation(triggers.hold_seconds, triggers.recover_seconds)
        self.counts = ModelCounts()
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


@dataclass
class Choice:
    """Where one request goes."""

    slot: ModelSlot
    served: Served
    route: Route | None = None
    fallback_from: str | None = None  # the model asked for, when its fallback answers

    @property
    def cascade(self) -> Cascade | None:
        return None if self.route is None else self.route.cascade


@dataclass
class Fleet:
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
        """Where a request for `requested` goes (404 for a name nobody serves)."""
        route = self.routes.get(requested)
        slot = self.slot(route.choose(caller) if route is not None else requested)
        fallback = slot.current.spec.fallback
        if slot.degradation.use_fallback and fallback is not None:
            target = self.slots[fallback]
            if not target.degradation.use_fallback:  # (never to a fallback that is itself degraded)
                slot.counts.fallbacks += 1
                target.counts.requests += 1
                return Choice(target, target.current, route, fallback_from=slot.name)
        slot.counts.requests += 1
        return Choice(slot, slot.current, route)

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


FLEET = web.AppKey("fleet", Fleet)
ANSWERED_BY = web.RequestKey("answered_by", str)  # the x-inferd-model header: "name@revision"
FALLBACK_FROM = web.RequestKey("fallback_from", str)  # the x-inferd-fallback-from header
CASCADE_TOKENS = web.RequestKey("cascade_tokens", int)  # a sure small answer's tokens


@dataclass(frozen=True)
class DegradedSteps:
    """What the functional ladder changes for one request (api/degradation.py)."""

    whole: bool = False  # a stream answered in one piece, at its end
    ceiling: int | None = None  # max_tokens at most this

    def max_tokens(self, requested: int) -> int:
        return requested if self.ceiling is None else min(requested, self.ceiling)

    def segment(self, body: SamplingFields) -> str:
        return "whole" if self.whole and body.stream else body.segment


def degradation_steps(choice: Choice, cls: PriorityClass, settings: Settings) -> DegradedSteps:
    """The ladder's steps for a request of `cls` to `choice`'s model; 503 while its class is refused."""
    d, ladder = settings.degradation, choice.slot.ladder
    if cls.name not in d.classes or ladder.level == 0:
        return DegradedSteps()
    ranks = {c.name: i for i, c in enumerate(choice.served.door.policy.ranked)}  # best first
    lowest = max(d.classes, key=lambda name: ranks.get(name, -1))
    if ladder.refuses(cls.name, lowest):
        raise APIError(503, f"model {choice.slot.name} is overloaded: class {cls.name!r} is refused for now "
                            f"(degradation level {ladder.name})", code="degraded",
                       headers={"Retry-After": str(max(1, round(d.recover_seconds)))})
    return DegradedSteps(whole=ladder.stream_whole(), ceiling=d.max_tokens_ceiling if ladder.level >= 2 else None)


def single_fleet(engine: AsyncEngine, settings: Settings, loader: Loader | None = None) -> Fleet:
    """A fleet of the one engine given (tests, and `inferd serve` without [models] tables)."""
    name = served_name(settings, engine.limits.model_path)
    server = ServerState(name)
    spec = ModelSpec(name=name, path=settings.model.path)
    slot = ModelSlot(Served(spec, engine, server, settings.server.probe_interval_seconds), triggers(settings))
    return Fleet(server, {name: slot}, loader=loader)


def load_fleet(settings: Settings, loader: Loader) -> Fleet:
    """Load every model of the settings, one after the other, in their order."""
    specs = model_specs(settings)
    if not settings.models:
        return single_fleet(loader(specs[0]), settings, loader)
    server = ServerState(specs[0].name)
    slots = {}
    for spec in specs:
        log.info("loading model %s revision %s from %s", spec.name, spec.revision, spec.path or "the embedded file")
        slots[spec.name] = ModelSlot(Served(spec, loader(spec), server, settings.server.probe_interval_seconds),
                                     triggers(settings))
    return Fleet(server, slots, build_routes(settings.routes), loader)


def triggers(settings: Settings) -> Triggers:
    d = settings.degradation
    return Triggers(queue_p95_seconds=d.queue_p95_seconds, preemptions_per_minute=d.preemptions_per_minute,
                    ooms_per_minute=d.ooms_per_minute, hold_seconds=d.hold_seconds, recover_seconds=d.recover_seconds)
