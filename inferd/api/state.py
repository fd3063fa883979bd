"""The application's typed keys and the server's own state (the engine's lives in its snapshot)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from inferd.api.backpressure import SlowClientCounts
from inferd.api.door import FrontDoor
from inferd.api.gateway import Gateway
from inferd.api.resume import StreamRegistry
from inferd.config import Settings
from inferd.engine.async_engine import AsyncEngine


@dataclass
class ModelHealth:
    """One loaded revision's inference probe verdict (probe.py writes it; event loop only)."""

    probed: bool = False  # the start-up inference probe has run
    probe_error: str | None = None  # the last probe's failure, if it failed


@dataclass
class ServerState:
    """The server's life, for /ready and /v1/status; written on the event loop only."""

    model_name: str  # the first model's name (the one of a single-model server)
    started: float = field(default_factory=time.monotonic)
    probed: bool = False  # every model's start-up inference probe has run
    draining: bool = False
    drain_cut: int = 0  # requests still running when the drain's grace period ended
    slow_clients: SlowClientCounts = field(default_factory=SlowClientCounts)


ENGINE = web.AppKey("engine", AsyncEngine)
DOOR = web.AppKey("door", FrontDoor)
GATEWAY = web.AppKey("gateway", Gateway)
STATE = web.AppKey("state", ServerState)
SETTINGS = web.AppKey("settings", Settings)
SSE_RESPONSES = web.AppKey("sse_responses", set[web.StreamResponse])  # open streams, for shutdown
RESUMABLE = web.AppKey("resumable", StreamRegistry)  # resumable streams by response id (resume.py)
