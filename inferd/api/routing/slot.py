"""One served name's slot: the revision serving it (None while it is not loaded), the one before,
the revisions retiring, its life (life.py: models on demand, sleep), its degradation and the
counts that outlive its revisions (registry.py holds every slot)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from inferd.api.admission.door import DoorCounts
from inferd.api.errors import APIError
from inferd.api.routing.degradation import FunctionalDegradation, ModelDegradation, Triggers
from inferd.api.routing.life import SlotLife, SlotState
from inferd.api.routing.served import ModelSpec, Served
from inferd.engine.protocol import EngineSnapshot
from inferd.settings.models import DegradationSettings

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05  # how often a retiring revision looks again


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
    """One served name: the revision serving it now (None while it is not loaded), the one before
    (for a rollback), the revisions retiring (draining their in-flight requests), its life
    (life.py), its degradation and its counts."""

    def __init__(self, spec: ModelSpec, served: Served | None, degradation: DegradationSettings) -> None:
        self.spec = spec  # what it loads next (current.spec while one serves)
        self.pinned, self.idle_unload_seconds = spec.pinned, spec.idle_unload_seconds  # (a SIGHUP reads them again)
        self.current = served
        self.life = SlotLife(SlotState.SERVING if served is not None else SlotState.UNLOADED)
        self.limits = None if served is None else served.engine.limits  # the last loaded revision's
        self.previous: ModelSpec | None = None
        self.retiring: list[Served] = []
        self.settings = degradation
        self.degradation = ModelDegradation(triggers(degradation))
        self.ladder = FunctionalDegradation(degradation.hold_seconds, degradation.recover_seconds)
        self.counts = ModelCounts(door=served.door.counts if served is not None else DoorCounts())
        self.lock = asyncio.Lock()  # one reload, load, unload, sleep or wake at a time

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def latest_spec(self) -> ModelSpec:
        """The serving revision's spec, else the one it loads next."""
        return self.current.spec if self.current is not None else self.spec

    @property
    def serving(self) -> Served | None:
        """The revision serving requests now; None while it is not (not loaded, asleep, moving)."""
        return self.current if self.life.state is SlotState.SERVING else None

    @property
    def engine_snapshot(self) -> EngineSnapshot | None:
        """Its engine's figures; None while it has none (not loaded, or asleep: its KV cache is gone)."""
        if self.current is None or self.life.state is SlotState.ASLEEP:
            return None
        return self.current.engine.snapshot

    @property
    def healthy(self) -> bool:
        """Serving: its probe passes and its engine runs; otherwise: its last load did not fail."""
        served = self.serving
        return served.healthy if served is not None else self.life.state is not SlotState.FAILED

    def forget_degradation(self) -> None:
        """Unloaded, its revision takes its degradation with it: the next load starts clear (else a
        model degraded, then unloaded, would send its requests to its fallback for good). Its
        switch and step counts stay."""
        switches, changes = self.degradation.switches, self.ladder.changes
        self.degradation = ModelDegradation(triggers(self.settings))
        self.ladder = FunctionalDegradation(self.settings.hold_seconds, self.settings.recover_seconds)
        self.degradation.switches, self.ladder.changes = switches, changes

    def retire(self, old: Served) -> None:
        """`old` keeps its in-flight requests; once they have ended its engine stops."""
        self.retiring.append(old)
        asyncio.ensure_future(self._retire(old))

    async def _retire(self, old: Served) -> None:
        while not old.idle:
            await asyncio.sleep(POLL_SECONDS)
        await old.stop()
        self.retiring.remove(old)
        log.info("model %s: revision %s retired", self.name, old.spec.revision)

    def ladder_steps(self, served: Served, class_name: str) -> tuple[int | None, bool]:
        """(max_tokens ceiling, answered whole) for a request of the class on `served`, as the
        functional ladder stands; 503 while the class is refused."""
        d, ladder = self.settings, self.ladder
        if class_name not in d.classes or ladder.level == 0:
            return None, False
        ranks = {c.name: i for i, c in enumerate(served.door.limits.policy.ranked)}  # best first
        lowest = max(d.classes, key=lambda name: ranks.get(name, -1))
        if ladder.refuses(class_name, lowest):
            raise APIError(503, f"model {self.name} is overloaded: class {class_name!r} is refused for now "
                                f"(degradation level {ladder.name})", code="degraded",
                           headers={"Retry-After": str(max(1, round(d.recover_seconds)))})
        return (d.max_tokens_ceiling if ladder.level >= 2 else None), ladder.stream_whole()


def triggers(d: DegradationSettings) -> Triggers:
    return Triggers(queue_p95_seconds=d.queue_p95_seconds, preemptions_per_minute=d.preemptions_per_minute,
                    ooms_per_minute=d.ooms_per_minute, hold_seconds=d.hold_seconds, recover_seconds=d.recover_seconds)
