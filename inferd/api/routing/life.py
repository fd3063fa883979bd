"""A model slot's life: the state it is in, and the counts of its loads, unloads and sleeps
(lifecycle.py moves it from one state to the next; holds.py waits on it).

    unloaded --a request--> loading --probe passed--> serving --idle, or room for another--> unloading
        ^  ^                   |                       |  ^                                     |
        |  '--- failed <-------'  (bad file, probe)    |  '-------- waking <---- asleep <-------+ (sleep)
        '----------------------------------------------+------------------------------------------'
                                                                   (1: weights kept; 2: freed too)

`current` is a Served in serving, unloading (until it has stopped) and asleep at level 1; None in
unloaded, failed, loading and asleep at level 2. Only the event loop reads or writes any of this.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field


class SlotState(enum.StrEnum):
    SERVING = "serving"
    LOADING = "loading"  # loading on demand (or from a level-2 sleep: then WAKING)
    UNLOADING = "unloading"  # stopping: new requests wait, running ones finish (an unload or a sleep)
    ASLEEP = "asleep"  # an admin put it to sleep (level 1 or 2); requests wait for the wake
    WAKING = "waking"
    UNLOADED = "unloaded"  # an on-demand model not loaded yet, or unloaded (idle, or room for another)
    FAILED = "failed"  # its last load failed (the reason in SlotLife.error); the next request tries again


STATES = tuple(SlotState)


@dataclass
class LifeCounts:
    """One model's lifecycle counts, for /metrics and /v1/status."""

    loads: int = 0  # loads that served (on demand, or a wake from level 2)
    load_failures: int = 0  # loads that failed (file, memory, probe)
    unloads: int = 0  # unloads (idle, or room for another model)
    switches: int = 0  # its loads that unloaded another model to make room
    sleeps: int = 0
    wakes: int = 0
    load_waits: int = 0  # requests that waited for it to load, wake or find room
    load_wait_timeouts: int = 0  # of which gave up after [server] model_load_wait_seconds (503)
    load_seconds: float = 0.0  # the last load's (or wake's) seconds


@dataclass
class SlotLife:
    state: SlotState
    level: int = 0  # asleep: 1 (weights kept) or 2 (freed too)
    since: float = field(default_factory=time.monotonic)  # when the state began
    last_used: float = field(default_factory=time.monotonic)  # the last hold's end (LRU, idle unload)
    error: str | None = None  # why the last load failed
    attempt: int = 0  # loads started: a waiter knows whether the one it waited on failed
    reserved: bool = False  # a load that has its room: counted in models_max before it serves
    task: asyncio.Task[None] | None = None  # the load or wake running (held, so it is not collected)
    counts: LifeCounts = field(default_factory=LifeCounts)

    def move(self, state: SlotState, level: int = 0) -> None:
        self.state, self.level, self.since = state, level, time.monotonic()


class Changes:
    """Wakes whoever waits for a slot's state to change or a hold to end (waiters also look
    again every POLL_SECONDS: a request's end in an engine is not announced here)."""

    POLL_SECONDS = 0.05

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        """Until the next change, or `timeout` (at most POLL_SECONDS) seconds."""
        try:
            await asyncio.wait_for(self._event.wait(), min(max(timeout, 0.0), self.POLL_SECONDS))
        except TimeoutError:
            pass
