"""Each priority class's bounded waiting queue at the door, checked before a request reaches
the engine.

The model's door owns it, on the event loop: `enter` when a request is admitted, `leave` when
the engine reports it scheduled (or it ended first), `record_prefill` from the engine's step
reports. One thread, so a burst can never slip past the bounds. Checks, in order:

    1. draining                                  -> 503 "draining"
    2. shed_level >= 1 and the class sheddable   -> 429 "shed"
    3. queued requests / prompt tokens + these
       over max_waiting / max_queued_tokens      -> 429 "queue_full" / "queue_tokens"
    4. predicted TTFT over the request's deadline -> 429 "deadline"

Retry-After comes from what was measured: the class's queue drain rate (requests and tokens
that left it per second over the last `window_seconds`) for a full queue, the prefill rate for a
missed deadline. No torch, no asyncio: the clock is injected, so tests use a fake one.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence

from inferd.settings.policy import PriorityClass

REASONS = ("queue_full", "queue_tokens", "deadline", "shed", "draining")
DRAINING_RETRY_AFTER = 5  # seconds: long enough for a load balancer to take this replica out
# NOTE: with no departures in the window there is no rate to divide by. 10 s is a guess that
# errs short: a queue that is moving will have room by then, and a client that comes back too
# early costs one cheap 429, while a guess that errs long idles capacity.
UNMEASURED_RETRY_AFTER = 10
RETRY_AFTER_MIN, RETRY_AFTER_MAX = 1, 60
# NOTE: the prefill rate is tokens / seconds over the engine steps of the last window, but the
# newest few steps are kept however old, so the rate survives an idle spell: the hardware did
# not get slower while nobody was asking.
_PREFILL_KEEP_STEPS = 8


class AdmissionError(Exception):
    """A request refused at the door. The HTTP layer maps it to `status` with a Retry-After
    header of `retry_after` seconds and `message` in the body."""

    def __init__(self, status: int, reason: str, retry_after: int, class_name: str, message: str,
                 *, oversized: bool = False) -> None:
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retry_after = max(RETRY_AFTER_MIN, retry_after)
        self.class_name = class_name
        self.message = message
        # the call alone is larger than the class's queue: it can never be admitted, and
        # retrying will not help (the HTTP layer may turn this into a 400)
        self.oversized = oversized


def _clamp_retry(seconds: float) -> int:
    return min(RETRY_AFTER_MAX, max(RETRY_AFTER_MIN, math.ceil(seconds)))


class _Queue:
    """One class's admitted-but-not-yet-scheduled counts and its recent departures."""

    def __init__(self, cls: PriorityClass) -> None:
        self.cls = cls
        self.requests = 0
        self.tokens = 0
        self.departures: deque[tuple[float, int, int]] = deque()  # (time, requests, tokens)
        self.departed_requests = 0  # sums over `departures`
        self.departed_tokens = 0

    def expire(self, cutoff: float) -> None:
        while self.departures and self.departures[0][0] < cutoff:
            _, n, t = self.departures.popleft()
            self.departed_requests -= n
            self.departed_tokens -= t


class ClassQueues:
    def __init__(self, classes: Sequence[PriorityClass], clock: Callable[[], float] = time.monotonic,
                 window_seconds: float = 30.0, rejections: Counter[tuple[str, str]] | None = None) -> None:
        if window_seconds <= 0:
            raise ValueError(f"window_seconds must be > 0, got {window_seconds}")
        self.clock = clock
        self.window_seconds = window_seconds
        self._queues = {c.name: _Queue(c) for c in classes}
        self._started = clock()
        self._prefill: deque[tuple[float, int, float]] = deque()  # (time, tokens, seconds)
        self._prefill_tokens = 0  # sums over `_prefill`
        self._prefill_seconds = 0.0
        # (class_name, reason) -> count; the model's slot owns it, so it outlives this revision
        self.rejections: Counter[tuple[str, str]] = Counter() if rejections is None else rejections

    # arrivals

    def enter(self, class_name: str, num_requests: int, prompt_tokens: int, *, draining: bool = False,
              shed_level: int = 0, ttft_deadline: float | None = None, recover_seconds: float = 10.0) -> None:
        """Count `num_requests` requests carrying `prompt_tokens` prompt tokens in all into the
        class's queue, or raise AdmissionError and count none of them. `draining`: the server
        admits nothing new (its one switch is ServerState.draining)."""
        if num_requests < 1 or prompt_tokens < 0:
            raise ValueError(f"need num_requests >= 1 and prompt_tokens >= 0, "
                             f"got {num_requests} and {prompt_tokens}")
        q = self._queues[class_name]
        err = self._check(q, num_requests, prompt_tokens, draining, shed_level, ttft_deadline,
                          recover_seconds)
        if err is not None:
            self.rejections[(class_name, err.reason)] += 1
            raise err
        q.requests += num_requests
        q.tokens += prompt_tokens

    # departures and measurements (reported by the engine, delivered on the event loop)

    def leave(self, class_name: str, num_requests: int, prompt_tokens: int) -> None:
        """These requests left the class's queue: first scheduled, or ended while waiting."""
        if num_requests < 0 or prompt_tokens < 0:
            raise ValueError(f"cannot leave negative counts ({num_requests}, {prompt_tokens})")
        q = self._queues[class_name]
        if num_requests > q.requests or prompt_tokens > q.tokens:
            raise ValueError(f"class {class_name!r}: leaving {num_requests} requests / "
                             f"{prompt_tokens} tokens but only {q.requests} / {q.tokens} queued")
        q.requests -= num_requests
        q.tokens -= prompt_tokens
        now = self.clock()
        q.departures.append((now, num_requests, prompt_tokens))
        q.departed_requests += num_requests
        q.departed_tokens += prompt_tokens
        q.expire(now - self.window_seconds)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """One engine step computed `tokens` prompt tokens in `seconds` (its whole duration, so
        decode work sharing the step counts against the rate, as it delays prefill)."""
        if tokens < 0 or seconds < 0:
            raise ValueError(f"need tokens >= 0 and seconds >= 0, got {tokens} and {seconds}")
        if tokens == 0 or seconds == 0:
            return  # a decode-only step says nothing about prefill speed
        self._prefill.append((self.clock(), tokens, seconds))
        self._prefill_tokens += tokens
        self._prefill_seconds += seconds
        self._expire_prefill()

    # reading

    def queued(self, class_name: str) -> tuple[int, int]:
        """(requests, prompt tokens) admitted to the class and not yet left."""
        q = self._queues[class_name]
        return q.requests, q.tokens

    def prefill_rate(self) -> float | None:
        """Measured prompt tokens per second; None before any prefill was recorded."""
        return self._prefill_rate()

    def predicted_ttft(self, class_name: str, prompt_tokens: int) -> float | None:
        """Seconds until a new request of the class with `prompt_tokens` would finish prefill:
        the prompt tokens queued ahead of it (its class and every more important one) plus its
        own, at the measured prefill rate. None before a rate is measured."""
        predicted = self._predict(self._queues[class_name].cls, prompt_tokens)
        return None if predicted is None else predicted[0]

    # internals 

    def _check(self, q: _Queue, num_requests: int, prompt_tokens: int, draining: bool, shed_level: int,
               ttft_deadline: float | None, recover_seconds: float) -> AdmissionError | None:
        c = q.cls
        if draining:
            return AdmissionError(503, "draining", DRAINING_RETRY_AFTER, c.name,
                                  f"the server is shutting down and admits no new requests "
                                  f"(class {c.name!r}); retry in {DRAINING_RETRY_AFTER} s")
        if shed_level >= 1 and c.sheddable:
            retry = max(RETRY_AFTER_MIN, math.ceil(recover_seconds))
            return AdmissionError(429, "shed", retry, c.name,
                                  f"class {c.name!r} is being shed (load-shedding level "
                                  f"{shed_level}) to protect higher-priority traffic; "
                                  f"retry in {retry} s")
        if q.requests + num_requests > c.max_waiting:
            return self._queue_error(q, "queue_full", "requests", q.requests, num_requests,
                                     c.max_waiting, "max_waiting")
        if q.tokens + prompt_tokens > c.max_queued_tokens:
            return self._queue_error(q, "queue_tokens", "prompt tokens", q.tokens, prompt_tokens,
                                     c.max_queued_tokens, "max_queued_tokens")
        if ttft_deadline is not None:
            predicted = self._predict(c, prompt_tokens)
            if predicted is not None and predicted[0] > ttft_deadline:
                ttft, ahead, rate = predicted
                return AdmissionError(429, "deadline", _clamp_retry(ttft - ttft_deadline), c.name,
                                      f"class {c.name!r}: predicted time to first token "
                                      f"{ttft:.1f} s ({ahead} prompt tokens queued ahead plus "
                                      f"{prompt_tokens} of this request at {rate:.0f} tokens/s) "
                                      f"exceeds the deadline of {ttft_deadline:.1f} s")
        return None

    def _queue_error(self, q: _Queue, reason: str, unit: str, queued: int, new: int, limit: int,
                     key: str) -> AdmissionError:
        name = q.cls.name
        if new > limit:
            return AdmissionError(429, reason, RETRY_AFTER_MAX, name,
                                  f"class {name!r}: {new} {unit} in one request exceed the "
                                  f"queue's size ({key} {limit}), so it can never be admitted",
                                  oversized=True)
        now = self.clock()
        q.expire(now - self.window_seconds)
        departed = q.departed_tokens if reason == "queue_tokens" else q.departed_requests
        # NOTE: a server up for less than a window has measured over less time than that
        span = min(self.window_seconds, now - self._started)
        if departed == 0 or span <= 0:
            retry = UNMEASURED_RETRY_AFTER
        else:
            excess = queued + new - limit
            retry = _clamp_retry(excess / (departed / span))
        return AdmissionError(429, reason, retry, name,
                              f"class {name!r} queue is full: {queued} {unit} waiting + {new} "
                              f"new > {key} {limit}; retry in {retry} s")

    def _predict(self, cls: PriorityClass, prompt_tokens: int) -> tuple[float, int, float] | None:
        """(predicted TTFT, prompt tokens queued ahead, prefill rate) or None without a rate."""
        rate = self._prefill_rate()
        if rate is None:
            return None
        ahead = sum(q.tokens for q in self._queues.values() if q.cls.priority <= cls.priority)
        return (ahead + prompt_tokens) / rate, ahead, rate

    def _prefill_rate(self) -> float | None:
        self._expire_prefill()
        if self._prefill_seconds <= 0:
            return None
        return self._prefill_tokens / self._prefill_seconds

    def _expire_prefill(self) -> None:
        cutoff = self.clock() - self.window_seconds
        while len(self._prefill) > _PREFILL_KEEP_STEPS and self._prefill[0][0] < cutoff:
            _, tokens, seconds = self._prefill.popleft()
            self._prefill_tokens -= tokens
            self._prefill_seconds -= seconds
