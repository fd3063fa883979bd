"""One loaded revision of a model: what to load (`ModelSpec`) and what it serves with (`Served`:
its engine, its door, its inference probe)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from inferd.api.admission.door import DoorCounts, FrontDoor
from inferd.api.routing.degradation import Signals
from inferd.api.routing.probe import InferenceProbe, ModelHealth
from inferd.api.state import ServerState
from inferd.engine.async_engine import AsyncEngine
from inferd.settings.config import Settings

POLL_SECONDS = 0.05  # how often a revision waiting for its probe looks again


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
    # what it serves and how it pools ([models.NAME] task, pooling, normalize, embeddings); None: [model]'s
    pooling: dict[str, object] = field(default_factory=dict)
    # when it is loaded and kept (lifecycle.py); not what it is: a change reloads nothing
    load: str = field(default="start", compare=False)  # "start" | "on_demand"
    pinned: bool = field(default=False, compare=False)  # never unloaded to make room or when idle
    idle_unload_seconds: float | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        """The x-inferd-model header: which model and revision answered."""
        return f"{self.name}@{self.revision}"


class Served:
    """One loaded revision of a model: its engine, its door (checks, admission) and its probe.
    `counts` are its slot's, shared by every revision of the model."""

    def __init__(self, spec: ModelSpec, engine: AsyncEngine, server: ServerState, settings: Settings,
                 counts: DoorCounts | None = None) -> None:
        self.spec = spec
        self.engine = engine
        self.settings = settings
        self.door = FrontDoor(engine, server, settings.limits, counts, settings.cache)
        self.health = ModelHealth()
        self.probe = InferenceProbe(engine, self.health, settings.server.probe_interval_seconds, server)
        self._probing: asyncio.Task[None] | None = None
        self.holders = 0  # requests holding it (routing/holds.py): an unload or a sleep waits for them

    @property
    def idle(self) -> bool:
        """Nobody holds it and no request of its runs (a detached stream's included)."""
        return not self.holders and not self.engine.open_requests

    async def start(self) -> None:
        """The engine thread, then the probe (start-up, then periodic) in a task of its own."""
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
