"""Per-tenant rate limits with a fake clock: bursts, refill, all-or-nothing admission, refunds,
NeverFits, exact retry-after, OpenAI's x-ratelimit-* headers and reloads that keep levels."""

from __future__ import annotations

import math

import pytest

from inferd.api.gateway.ratelimit import (NeverFits, RateLimited, RateLimits, TenantLimiter, TokenBucket,
                                  duration, retry_after_header)


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(**limits: float | int | None) -> tuple[TenantLimiter, FakeClock]:
    clock = FakeClock(100.0)
    return TenantLimiter(RateLimits(**limits), clock=clock), clock


def limited(limiter: TenantLimiter, tokens: int) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        limiter.take(tokens)
    return info.value


# ------------------------------------------------------------------------------ TokenBucket


def test_bucket_starts_full_and_refills_lazily() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, capacity=5, clock=clock)
    assert bucket.level == 5 and bucket.remaining() == 5 and bucket.reset_seconds() == 0
    assert bucket.try_take(4) and bucket.remaining() == 1
    assert not bucket.try_take(2) and bucket.remaining() == 1  # refused: nothing taken
    assert bucket.wait_for(2) == pytest.approx(0.5) and bucket.reset_seconds() == pytest.approx(2.0)
    clock.now = 0.25
    assert bucket.level == pytest.approx(1.5) and bucket.remaining() == 1
    clock.now = 0.5
    assert bucket.try_take(2) and bucket.remaining() == 0
    clock.now = 100.0
    assert bucket.level == 5  # never above capacity
    assert bucket.wait_for(6) == math.inf and bucket.wait_for(0) == 0


def test_bucket_give_back_caps_at_capacity() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=1.0, capacity=10, clock=clock)
    assert bucket.try_take(8)
    bucket.give_back(3)
    assert bucket.remaining() == 5
    bucket.give_back(100)
    assert bucket.level == 10
    with pytest.raises(ValueError):
        bucket.give_back(-1)


def test_waiting_exactly_wait_for_is_enough() -> None:
    clock = FakeClock(0.1)
    bucket = TokenBucket(rate=0.3, capacity=7, clock=clock)  # rates that are not exact in binary
    assert bucket.try_take(7)
    wait = bucket.wait_for(3)
    assert wait == pytest.approx(10.0)
    clock.now += wait
    assert bucket.remaining() == 3 and bucket.try_take(3)


@pytest.mark.parametrize(("rate", "capacity"), [(0, 1), (-1, 1), (1, 0), (math.inf, 1), (1, math.nan)])
def test_bucket_rejects_bad_settings(rate: float, capacity: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, capacity, FakeClock())


# ------------------------------------------------------------------------------- RateLimits


def test_limits_default_burst_and_validation() -> None:
    assert RateLimits().requests_capacity is None and RateLimits().tokens_capacity is None
    assert RateLimits(requests_per_second=2.5).requests_capacity == 3
    assert RateLimits(requests_per_second=0.1).requests_capacity == 1
    assert RateLimits(tokens_per_second=100, tokens_burst=5000).tokens_capacity == 5000
    with pytest.raises(ValueError, match="tokens_burst is set but tokens_per_second is not"):
        RateLimits(tokens_burst=10)
    with pytest.raises(ValueError, match="requests_per_second must be a number > 0"):
        RateLimits(requests_per_second=0)
    with pytest.raises(ValueError, match="requests_burst must be an integer >= 1"):
        RateLimits(requests_per_second=1, requests_burst=0)
    with pytest.raises(ValueError, match="tokens_burst must be an integer"):
        RateLimits(tokens_per_second=1, tokens_burst=2.5)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- TenantLimiter


def test_burst_then_refusal_then_refill() -> None:
    limiter, clock = make(requests_per_second=2, requests_burst=3)
    for _ in range(3):
        charge = limiter.take(0)
        assert (charge.requests, charge.tokens, charge.refunded) == (1, 0, False)
    err = limited(limiter, 0)
    assert (err.kind, err.limit) == ("requests", 3)
    assert err.retry_after == pytest.approx(0.5)
    assert str(err) == err.message and "Rate limit reached for requests" in err.message and "500ms" in err.message
    clock.now += 0.5
    limiter.take(0)
    assert limited(limiter, 0).retry_after == pytest.approx(0.5)
    clock.now += 10
    assert limiter.remaining_requests == 3


def test_unlimited_admits_everything() -> None:
    limiter, _ = make()
    for _ in range(1000):
        charge = limiter.take(10**6)
        assert (charge.requests, charge.tokens) == (0, 0)
    assert limiter.headers() == {}
    assert limiter.remaining_requests is None and limiter.remaining_tokens is None


def test_all_or_nothing() -> None:
    limiter, _ = make(requests_per_second=1, requests_burst=5, tokens_per_second=10, tokens_burst=100)
    limiter.take(90)
    err = limited(limiter, 20)  # 10 tokens left: a token refusal takes no request
    assert (err.kind, err.limit) == ("tokens", 100) and err.retry_after == pytest.approx(1.0)
    assert (limiter.remaining_requests, limiter.remaining_tokens) == (4, 10)
    for _ in range(4):
        limiter.take(0)
    err = limited(limiter, 5)  # tokens there, no request left: no tokens taken
    assert err.kind == "requests" and err.retry_after == pytest.approx(1.0)
    assert (limiter.remaining_requests, limiter.remaining_tokens) == (0, 10)


def test_retry_after_is_when_both_fit() -> None:
    limiter, clock = make(requests_per_second=1, requests_burst=1, tokens_per_second=10, tokens_burst=100)
    limiter.take(100)
    err = limited(limiter, 40)  # a request in 1 s, 40 tokens in 4 s: the tokens bind
    assert err.kind == "tokens" and err.retry_after == pytest.approx(4.0)
    clock.now += err.retry_after
    assert limiter.take(40).tokens == 40


def test_retry_after_exact_and_header() -> None:
    limiter, clock = make(tokens_per_second=4, tokens_burst=20)
    limiter.take(18)
    err = limited(limiter, 9)  # 2 there, 7 short at 4/s
    assert err.retry_after == pytest.approx(1.75)
    assert retry_after_header(err.retry_after) == "2"
    clock.now += 1.7
    assert limited(limiter, 9).retry_after == pytest.approx(0.05)
    assert retry_after_header(0.05) == "1" and retry_after_header(0) == "1" and retry_after_header(3.0) == "3"
    with pytest.raises(ValueError):
        retry_after_header(math.inf)


def test_never_fits() -> None:
    limiter, _ = make(requests_per_second=1, tokens_per_second=10, tokens_burst=100)
    with pytest.raises(NeverFits) as info:
        limiter.take(101)
    assert (info.value.tokens, info.value.capacity) == (101, 100) and isinstance(info.value.capacity, int)
    assert str(info.value) == "the request needs 101 tokens; the tenant's tokens_burst is 100"
    assert (limiter.remaining_requests, limiter.remaining_tokens) == (1, 100)  # nothing taken
    limiter.take(100)
    with pytest.raises(NeverFits):  # over capacity wins over an empty bucket: waiting will not help
        limiter.take(101)


def test_refund_once() -> None:
    limiter, _ = make(tokens_per_second=1, tokens_burst=1000)
    charge = limiter.take(600)  # prompt + max_tokens
    assert limiter.remaining_tokens == 400
    assert limiter.refund(charge, used_tokens=250) == 350
    assert limiter.remaining_tokens == 750 and charge.refunded
    assert limiter.refund(charge, used_tokens=0) == 0  # a second call is a no-op
    assert limiter.remaining_tokens == 750
    over = limiter.take(100)
    assert limiter.refund(over, used_tokens=120) == 0 and limiter.remaining_tokens == 650
    assert limiter.headers()["x-ratelimit-remaining-tokens"] == "650"


def test_refund_never_above_capacity() -> None:
    limiter, clock = make(tokens_per_second=10, tokens_burst=100)
    charge = limiter.take(80)
    clock.now += 60  # full again before the request ends
    assert limiter.refund(charge, used_tokens=0) == 80
    assert limiter.remaining_tokens == 100


def test_headers_only_for_limits_on() -> None:
    limiter, clock = make(requests_per_second=0.5, requests_burst=3)
    assert limiter.headers() == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "3", "x-ratelimit-reset-requests": "0s",
    }
    limiter.take(10**9)  # no token limit: any size fits
    headers = limiter.headers()
    assert headers["x-ratelimit-remaining-requests"] == "2" and headers["x-ratelimit-reset-requests"] == "2s"
    assert not any(k.endswith("-tokens") for k in headers)

    limiter, clock = make(tokens_per_second=1000, tokens_burst=360_000)
    limiter.take(360_000)
    headers = limiter.headers()
    assert set(headers) == {"x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"}
    assert headers == {"x-ratelimit-limit-tokens": "360000", "x-ratelimit-remaining-tokens": "0",
                       "x-ratelimit-reset-tokens": "6m0s"}
    clock.now += 359.98
    assert limiter.headers()["x-ratelimit-reset-tokens"] == "20ms"
    assert limiter.headers()["x-ratelimit-remaining-tokens"] == "359980"


def test_headers_both_limits_consistent() -> None:
    limiter, clock = make(requests_per_second=2, requests_burst=10, tokens_per_second=100, tokens_burst=1000)
    limiter.take(850)
    limiter.take(0)
    clock.now += 0.5
    h = limiter.headers()
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("10", "9")
    assert h["x-ratelimit-reset-requests"] == "500ms"  # 1 of 10 short at 2/s
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("1000", "200")
    assert h["x-ratelimit-reset-tokens"] == "8s"  # 800 short at 100/s


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (-1, "0s"), (0.0004, "1ms"), (0.02, "20ms"), (0.999, "999ms"), (1, "1s"), (1.5, "1.5s"),
    (7.66, "7.66s"), (59.9991, "1m0s"), (60, "1m0s"), (360, "6m0s"), (61.25, "1m1.25s"), (3600, "1h0m0s"),
    (3723, "1h2m3s"),
])
def test_duration(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_update_keeps_levels() -> None:
    limiter, clock = make(requests_per_second=1, requests_burst=10, tokens_per_second=10, tokens_burst=1000)
    for _ in range(4):
        limiter.take(100)
    assert (limiter.remaining_requests, limiter.remaining_tokens) == (6, 600)
    limiter.update(RateLimits(requests_per_second=2, requests_burst=20, tokens_per_second=10, tokens_burst=500))
    assert (limiter.remaining_requests, limiter.remaining_tokens) == (6, 500)  # kept; clipped to 500
    assert limiter.headers()["x-ratelimit-limit-requests"] == "20"
    clock.now += 1  # the new rates refill
    assert (limiter.remaining_requests, limiter.remaining_tokens) == (8, 500)
    with pytest.raises(NeverFits):
        limiter.take(501)
    limiter.update(RateLimits(tokens_per_second=10, tokens_burst=500))  # requests off
    assert limiter.remaining_requests is None and "x-ratelimit-limit-requests" not in limiter.headers()
    limiter.update(RateLimits(requests_per_second=1, requests_burst=4, tokens_per_second=10, tokens_burst=500))
    assert limiter.remaining_requests == 4  # newly on: starts full
    assert limiter.limits.requests_burst == 4


def test_update_refills_at_the_old_rate_up_to_now() -> None:
    limiter, clock = make(tokens_per_second=10, tokens_burst=100)
    limiter.take(100)
    clock.now += 5  # 50 refilled at 10/s before the reload
    limiter.update(RateLimits(tokens_per_second=1, tokens_burst=100))
    assert limiter.remaining_tokens == 50
    clock.now += 5
    assert limiter.remaining_tokens == 55
