"""The server's own state, and the application keys every stage reads: its settings and life.

Each stage keeps its own application key beside its state (the gateway's in gateway/gate.py,
the models' in routing/registry.py, the streams' in streaming/); these two are everyone's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from inferd.settings.config import Settings


@dataclass
class ServerState:
    """The server's life, for /ready, /v1/status and every model's door; written on the event
    loop only. `draining` is the one switch: once set, every door refuses new requests (503)."""

    model_name: str  # the first model's name (the one of a single-model server)
    started: float = field(default_factory=time.monotonic)
    probed: bool = False  # every model's start-up inference probe has run
    draining: bool = False
    drain_cut: int = 0  # requests still running when the drain's grace period ended


STATE = web.AppKey("state", ServerState)
SETTINGS = web.AppKey("settings", Settings)
