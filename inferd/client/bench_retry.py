"""`inferd bench --retries N`: send a request again after a failure that is safe to repeat.

    attempt 0 ──fail── sleep ── attempt 1 ──fail── sleep ── attempt 2 ── ok
    |<──────────────────────────── the request's TTFT, e2e ────────────────>|

What is retried (bench_metrics.retry_cause): a connection refused or reset, or closed before the
response's first SSE event; HTTP 429 and 503; and a stream cut mid-way (its server died), sent
again from the start with the cut attempt's tokens dropped, so none is counted twice.

The wait before retry k (0-based) is full jitter (AWS, "Exponential Backoff And Jitter"):

    uniform(0, min(cap, base × 2^k))             base 1 s (--retry-base), cap 30 s
    + min(Retry-After, cap)                      when the answer carried one

A retried request's times count from its first attempt's send, its waits included: that is the
latency its user sees.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from inferd.client.bench_http import send
from inferd.client.bench_metrics import RequestRecord, retry_cause

RETRY_BASE = 1.0  # seconds: the bound of the first backoff
RETRY_CAP = 30.0  # seconds: the most one backoff, or one Retry-After, may add
MAX_RETRIES = 100


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 0
    base: float = RETRY_BASE
    cap: float = RETRY_CAP

    def check(self) -> None:
        """ValueError naming the option for anything out of range."""
        if not 0 <= self.retries <= MAX_RETRIES:
            raise ValueError(f"--retries must be in [0, {MAX_RETRIES}], got {self.retries}")
        if not (self.base > 0 and math.isfinite(self.base)):
            raise ValueError(f"--retry-base must be > 0 seconds, got {self.base:g}")

    def bound(self, attempt: int) -> float:
        """The longest backoff before retry `attempt` (0-based): min(cap, base × 2^attempt)."""
        return min(self.cap, self.base * 2.0 ** min(attempt, 64))

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds to sleep before retry `attempt`: full jitter, plus the server's Retry-After.

        NOTE: the jitter is added to Retry-After, not just floored by it: clients refused
        together and told the same Retry-After would otherwise all come back at once."""
        wait = rng.uniform(0.0, self.bound(attempt))
        if retry_after is not None:
            wait += min(retry_after, self.cap)
        return wait


def parse_retry_after(value: str | None, now: datetime.datetime | None = None) -> float | None:
    """Retry-After in seconds: delay-seconds ("120") or an HTTP-date (a past one is 0); None when
    absent or not either form."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return max(0.0, (when - now).total_seconds())


async def send_retrying(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], template: RequestRecord, *,
    api_key: str | None, t0: float, policy: RetryPolicy, rng: random.Random,
    clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> RequestRecord:
    """`send`, then up to `policy.retries` more attempts after retryable failures. The record of
    the last attempt (index and priority from `template`), with attempts, retry_causes and
    retry_wait, its times counted from the first attempt's send."""
    start = clock()
    causes: list[str] = []
    waited = 0.0
    while True:
        record = RequestRecord(index=template.index, priority=template.priority)
        await send(session, url, body, record, api_key=api_key, t0=t0, clock=clock, start=start)
        cause = retry_cause(record)
        if cause is None or len(causes) >= policy.retries:
            break
        delay = policy.delay(len(causes), parse_retry_after(record.retry_after), rng)
        causes.append(cause)
        before = clock()
        await sleep(delay)
        waited += clock() - before
    record.attempts, record.retry_causes, record.retry_wait = len(causes) + 1, causes, waited
    return record
