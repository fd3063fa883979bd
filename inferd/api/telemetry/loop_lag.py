"""The event loop's lag: how late a periodic timer fires. Everything the server does for its
clients runs on one loop, so anything that holds it (a big prompt tokenized in place, a large
reply encoded) shows here first, as every stream's next chunk and /health wait the same time.

    every PERIOD s:  asyncio.sleep(PERIOD) -> woke up `lag` seconds late -> histogram, worst recent
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from aiohttp import web

from inferd.engine.protocol import Histogram

PERIOD = 0.05  # seconds between ticks: finer than the 0.25 s a stream's gap may grow to
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
RECENT = 200  # ticks the worst recent lag is taken over (~10 s)


@dataclass
class LoopLag:
    """The loop's lateness so far (a histogram) and over the last RECENT ticks."""

    histogram: Histogram = field(default_factory=lambda: Histogram(LAG_BUCKETS))
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    @property
    def worst_recent(self) -> float:
        return max(self.recent, default=0.0)

    async def watch(self) -> None:
        """Tick until cancelled, recording each tick's lateness."""
        while True:
            due = time.perf_counter() + PERIOD
            await asyncio.sleep(PERIOD)
            lag = max(0.0, time.perf_counter() - due)
            self.histogram.observe(lag)
            self.recent.append(lag)


LOOP_LAG = web.AppKey("loop_lag", LoopLag)
