"""The engine's own health: failed steps in a row, out-of-memory events, and whether it counts
as healthy. Written by the engine thread only; published in the snapshot.

    step ok ............................. consecutive = 0
    forward failed, the last step failed
      too and within `window_seconds` ... consecutive += 1   (else consecutive = 1)
    consecutive >= 2 .................... unhealthy (readiness 503) until `recover_seconds`
                                          pass with no further failure
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable

from inferd.engine.protocol import FAILURE_KINDS

UNHEALTHY_AFTER = 2  # failed steps in a row


class EngineHealth:
    def __init__(self, window_seconds: float, recover_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_seconds = window_seconds
        self.recover_seconds = recover_seconds
        self.clock = clock
        self.failures: Counter[str] = Counter()  # by kind, since start
        self.consecutive = 0  # forward failures with no successful step between them
        self.unhealthy_at: float | None = None  # when it last turned unhealthy
        self._last_failure = -float("inf")
        self._ooms: deque[float] = deque()  # times of the out-of-memory events of the last minute

    def step_ok(self) -> None:
        self.consecutive = 0

    def forward_failed(self) -> None:
        now = self.clock()
        self.failures["forward"] += 1
        in_a_row = self.consecutive > 0 and now - self._last_failure <= self.window_seconds
        self.consecutive = self.consecutive + 1 if in_a_row else 1
        self._last_failure = now
        if self.consecutive >= UNHEALTHY_AFTER:
            self.unhealthy_at = now

    def request_failed(self) -> None:
        self.failures["request"] += 1

    def out_of_memory(self) -> None:
        now = self.clock()
        self.failures["oom"] += 1
        self._ooms.append(now)
        self._expire(now)

    @property
    def healthy(self) -> bool:
        if self.consecutive >= UNHEALTHY_AFTER:
            return False
        return self.unhealthy_at is None or self.clock() - self.unhealthy_at >= self.recover_seconds

    def ooms_last_minute(self) -> int:
        self._expire(self.clock())
        return len(self._ooms)

    def _expire(self, now: float) -> None:
        while self._ooms and self._ooms[0] <= now - 60.0:
            self._ooms.popleft()
