"""Per-tenant rate limits at the gateway: requests per second and tokens per second, each a
token bucket, checked together.

The front door owns one `TenantLimiter` per tenant, on the event loop (one thread, no locks):
`admit(tokens)` when a request arrives, where `tokens` is what it may cost (prompt + max_tokens),
then `refund(charge, used)` when it ends, giving back what it did not use. Either limit may be
off. Buckets refill lazily from the injected clock, so tests use a fake one.

    admit(tokens)
      tokens > tokens_burst                  -> NeverFits (a 400: waiting will never help)
      1 request or `tokens` not available    -> RateLimited, nothing taken (a 429, Retry-After)
      otherwise                              -> both taken, a Charge

    level of a bucket (capacity = burst, refilled at `rate` per second):

      0 ........................ level ............ capacity
      |<-- taken, refilling ----->|<-- remaining -->|
                                   reset = (capacity - level) / rate

`headers()` reports the buckets as OpenAI does (x-ratelimit-{limit,remaining,reset}-{requests,
tokens}), so OpenAI clients back off on their own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

KINDS = ("requests", "tokens")
# NOTE: levels are floats refilled by `elapsed * rate`; waiting exactly `wait_for(n)` seconds can
# leave the level a few ulps short of n. A millionth of a token is forgiven.
_EPSILON = 1e-6


class RateLimited(Exception):
    """The tenant is over its `kind` limit; `retry_after` seconds from now both the request and
    its tokens will be available. The HTTP layer maps it to 429 with a Retry-After header."""

    def __init__(self, kind: str, retry_after: float, limit: float, message: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.retry_after = retry_after
        self.limit = _whole(limit)  # the bucket's capacity (burst)
        self.message = message


class NeverFits(Exception):
    """The request needs more tokens than the tenant's token bucket holds when full: no wait
    makes it fit. The HTTP layer maps it to 400."""

    def __init__(self, tokens: int, capacity: float) -> None:
        self.tokens = tokens
        self.capacity = _whole(capacity)
        self.message = f"the request needs {tokens} tokens; the tenant's tokens_burst is {self.capacity}"
        super().__init__(self.message)


class TokenBucket:
    """`capacity` units, refilled at `rate` per second; starts full."""

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic) -> None:
        _check_bucket(rate, capacity)
        self.rate = float(rate)
        self.capacity = float(capacity)
        self._clock = clock
        self._level = self.capacity
        self._stamp = clock()

    @property
    def level(self) -> float:
        """Units available now (refilled up to now first)."""
        now = self._clock()
        if now > self._stamp:
            self._level = min(self.capacity, self._level + (now - self._stamp) * self.rate)
            self._stamp = now
        return self._level

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` units are available: 0 if they are now, inf if never."""
        if amount < 0:
            raise ValueError(f"amount must be >= 0, got {amount}")
        if amount > self.capacity:
            return math.inf
        short = amount - self.level
        return 0.0 if short <= _EPSILON else short / self.rate

    def try_take(self, amount: float) -> bool:
        """Take `amount` units if they are available now; False (nothing taken) otherwise."""
        if self.wait_for(amount) > 0:
            return False
        self._level = max(0.0, self._level - amount)
        return True

    def give_back(self, amount: float) -> None:
        """Return units taken earlier (a refund); the level never goes above capacity."""
        if amount < 0:
            raise ValueError(f"amount must be >= 0, got {amount}")
        self._level = min(self.capacity, self.level + amount)

    def reset_seconds(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, self.capacity - self.level) / self.rate

    def remaining(self) -> int:
        """Whole units available now."""
        return math.floor(self.level + _EPSILON)

    def reconfigure(self, rate: float, capacity: float) -> None:
        """New rate and capacity, keeping the level (refilled at the old rate up to now, then
        clipped to the new capacity)."""
        _check_bucket(rate, capacity)
        level = self.level
        self.rate, self.capacity = float(rate), float(capacity)
        self._level = min(level, self.capacity)


@dataclass(frozen=True)
class RateLimits:
    """A tenant's limits; None turns that limit off. A burst given without its rate is an error;
    a rate given without its burst gets a burst of max(1, ceil(rate)), one second's worth."""

    requests_per_second: float | None = None
    requests_burst: int | None = None
    tokens_per_second: float | None = None
    tokens_burst: int | None = None

    def __post_init__(self) -> None:
        for kind in KINDS:
            rate, burst = getattr(self, f"{kind}_per_second"), getattr(self, f"{kind}_burst")
            if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                     or not math.isfinite(rate) or rate <= 0):
                raise ValueError(f"{kind}_per_second must be a number > 0 (or unset), got {rate!r}")
            if burst is not None and (isinstance(burst, bool) or not isinstance(burst, int) or burst < 1):
                raise ValueError(f"{kind}_burst must be an integer >= 1 (or unset), got {burst!r}")
            if burst is not None and rate is None:
                raise ValueError(f"{kind}_burst is set but {kind}_per_second is not: set both, or neither")

    @property
    def requests_capacity(self) -> int | None:
        """The request bucket's size: requests_burst, its default, or None when the limit is off."""
        return _capacity(self.requests_per_second, self.requests_burst)

    @property
    def tokens_capacity(self) -> int | None:
        """The token bucket's size: tokens_burst, its default, or None when the limit is off."""
        return _capacity(self.tokens_per_second, self.tokens_burst)


@dataclass(eq=False)
class Charge:
    """What one `admit` took: 1 request and `tokens` tokens (0 where that limit is off)."""

    requests: int
    tokens: int
    refunded: bool = False


class TenantLimiter:
    """One tenant's request and token buckets, taken all or nothing."""

    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.limits = limits
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.update(limits)

    def take(self, tokens: int) -> Charge:
        """Take 1 request and `tokens` tokens, or nothing: NeverFits if `tokens` is over the
        token bucket's capacity, RateLimited (for the limit that frees up last) if either is
        not available now."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if self.tokens is not None and tokens > self.tokens.capacity:
            raise NeverFits(tokens, self.tokens.capacity)
        waits = [(bucket.wait_for(amount), kind, bucket)
                 for kind, bucket, amount in (("requests", self.requests, 1), ("tokens", self.tokens, tokens))
                 if bucket is not None]
        wait, kind, bucket = max(waits, default=(0.0, "requests", None), key=lambda w: w[0])
        if bucket is not None and wait > 0:
            raise RateLimited(kind, wait, bucket.capacity, _message(kind, bucket, wait))
        if self.requests is not None:
            self.requests.try_take(1)
        if self.tokens is not None:
            self.tokens.try_take(tokens)
        return Charge(requests=int(self.requests is not None), tokens=tokens if self.tokens is not None else 0)

    def refund(self, charge: Charge, used_tokens: int) -> int:
        """Give back the tokens `charge` took but the request did not use; once per charge (a
        second call is a no-op). Returns the tokens given back."""
        if charge.refunded:
            return 0
        charge.refunded = True
        unused = charge.tokens - used_tokens
        if unused <= 0 or self.tokens is None:
            return 0
        self.tokens.give_back(unused)
        return unused

    @property
    def remaining_requests(self) -> int | None:
        return None if self.requests is None else self.requests.remaining()

    @property
    def remaining_tokens(self) -> int | None:
        return None if self.tokens is None else self.tokens.remaining()

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limits that are on: limit (the burst),
        remaining (whole units now) and reset (until full again, as "1s", "6m0s")."""
        headers: dict[str, str] = {}
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                headers[f"x-ratelimit-limit-{kind}"] = _number(bucket.capacity)
                headers[f"x-ratelimit-remaining-{kind}"] = str(bucket.remaining())
                headers[f"x-ratelimit-reset-{kind}"] = duration(bucket.reset_seconds())
        return headers

    def update(self, limits: RateLimits) -> None:
        """Apply new limits (a configuration reload): a bucket that stays on keeps its level,
        clipped to its new capacity; one newly on starts full; one turned off is dropped."""
        self.limits = limits
        self.requests = self._bucket(self.requests, limits.requests_per_second, limits.requests_capacity)
        self.tokens = self._bucket(self.tokens, limits.tokens_per_second, limits.tokens_capacity)

    def _bucket(self, bucket: TokenBucket | None, rate: float | None, capacity: int | None) -> TokenBucket | None:
        if rate is None or capacity is None:
            return None
        if bucket is None:
            return TokenBucket(rate, capacity, self._clock)
        bucket.reconfigure(rate, capacity)
        return bucket


# ------------------------------------------------------------------------------ formatting


def duration(seconds: float) -> str:
    """Seconds in OpenAI's reset format (Go's durations, to the millisecond, rounded up):
    0 -> "0s", 0.02 -> "20ms", 1 -> "1s", 1.5 -> "1.5s", 360 -> "6m0s", 3723 -> "1h2m3s"."""
    if not math.isfinite(seconds):
        raise ValueError(f"duration needs a finite number of seconds, got {seconds}")
    ms = max(0, math.ceil(seconds * 1000 - _EPSILON))
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms // 1000}.{ms % 1000:03d}".rstrip("0").rstrip(".")
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "") + f"{secs}s"


def retry_after_header(seconds: float) -> str:
    """The HTTP Retry-After value for a wait: whole seconds, rounded up, at least 1."""
    if not math.isfinite(seconds):
        raise ValueError(f"Retry-After needs a finite number of seconds, got {seconds}")
    return str(max(1, math.ceil(seconds - _EPSILON)))


def _whole(x: float) -> int | float:
    """100.0 -> 100: a capacity that is a whole number shows as one."""
    return int(x) if float(x).is_integer() else x


def _number(x: float) -> str:
    return str(_whole(x))


def _message(kind: str, bucket: TokenBucket, wait: float) -> str:
    return (f"Rate limit reached for {kind}: limit {_number(bucket.capacity)}, refilling at "
            f"{bucket.rate:g}/s. Please try again in {duration(wait)}.")


def _capacity(rate: float | None, burst: int | None) -> int | None:
    if rate is None:
        return None
    return burst if burst is not None else max(1, math.ceil(rate))


def _check_bucket(rate: float, capacity: float) -> None:
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0, got {rate}")
    if not (math.isfinite(capacity) and capacity > 0):
        raise ValueError(f"capacity must be a finite number > 0, got {capacity}")
