"""Per-key rate limits: the token buckets under a fake clock, then 429s from a live gateway."""

import pytest

from gateway.server.errors import rate_limited
from gateway.server.ratelimit import RateLimiter, RateLimitExceeded
from gateway.services.tenants import TenantLimits


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def limiter(clock):
    return RateLimiter(clock=clock)


def refused(limiter, key, limits):
    with pytest.raises(RateLimitExceeded) as info:
        limiter.admit(key, limits)
    return info.value


def test_requests_per_minute(limiter, clock):
    limits = TenantLimits(requests_per_minute=2)
    limiter.admit("k", limits).release(0)
    limiter.admit("k", limits).release(0)
    err = refused(limiter, "k", limits)
    assert err.limit == "requests_per_minute"
    assert err.retry_after == pytest.approx(30.0)  # one request refills in 60 / 2 s
    clock.advance(29.0)
    assert refused(limiter, "k", limits).retry_after == pytest.approx(1.0)
    clock.advance(1.0)
    limiter.admit("k", limits).release(0)
    assert refused(limiter, "k", limits).limit == "requests_per_minute"


def test_bucket_never_holds_more_than_a_minute(limiter, clock):
    limits = TenantLimits(requests_per_minute=3)
    clock.advance(3600.0)
    for _ in range(3):
        limiter.admit("k", limits).release(0)
    assert refused(limiter, "k", limits).retry_after == pytest.approx(20.0)


def test_tokens_per_minute_goes_negative_after_a_large_request(limiter, clock):
    limits = TenantLimits(tokens_per_minute=100)
    ticket = limiter.admit("k", limits)  # admitted: the bucket is positive
    ticket.release(250)  # charged afterwards: 100 - 250 = -150
    err = refused(limiter, "k", limits)
    assert err.limit == "tokens_per_minute"
    # back to +1 token at 100/60 tokens per second: 151 * 0.6 s
    assert err.retry_after == pytest.approx(90.6)
    clock.advance(90.0)  # level 0: still refused
    assert refused(limiter, "k", limits).retry_after == pytest.approx(0.6)
    clock.advance(0.6)
    limiter.admit("k", limits).release(10)


def test_max_concurrent_requests(limiter):
    limits = TenantLimits(max_concurrent_requests=1)
    first = limiter.admit("k", limits)
    err = refused(limiter, "k", limits)
    assert err.limit == "max_concurrent_requests" and err.retry_after > 0
    assert limiter.in_flight("k") == 1
    first.release(5)
    assert limiter.in_flight("k") == 0
    limiter.admit("k", limits).release(0)


def test_a_refusal_takes_nothing(limiter, clock):
    limits = TenantLimits(requests_per_minute=1, max_concurrent_requests=5)
    limiter.admit("k", limits).release(0)
    for _ in range(5):
        refused(limiter, "k", limits)
    assert limiter.in_flight("k") == 0
    clock.advance(60.0)  # exactly one refill: the refusals consumed nothing
    limiter.admit("k", limits).release(0)


def test_release_is_idempotent(limiter, clock):
    limits = TenantLimits(tokens_per_minute=60, max_concurrent_requests=2)
    a = limiter.admit("k", limits)
    b = limiter.admit("k", limits)
    a.release(30)
    a.release(30)
    a.release(1000)
    assert limiter.in_flight("k") == 1  # b is still in flight
    b.release(0)
    assert limiter.in_flight("k") == 0
    # 60 - 30 charged once: 30 tokens left, so admitted; a second charge would be visible here
    c = limiter.admit("k", limits)
    c.release(31)  # 30 - 31 = -1: refused until 2 tokens refill (2 s at 1 token/s)
    assert refused(limiter, "k", limits).retry_after == pytest.approx(2.0)


def test_none_is_unlimited(limiter):
    limits = TenantLimits()
    tickets = [limiter.admit("k", limits) for _ in range(1000)]
    assert limiter.in_flight("k") == 1000
    for t in tickets:
        t.release(10**9)
    assert limiter.in_flight("k") == 0
    limiter.admit("k", limits).release(0)


def test_keys_are_independent(limiter):
    limits = TenantLimits(requests_per_minute=1, max_concurrent_requests=1)
    held = limiter.admit("a", limits)
    limiter.admit("b", limits).release(0)
    refused(limiter, "a", limits)
    refused(limiter, "b", limits)
    held.release(0)


def test_retry_after_header_is_whole_seconds_at_least_one():
    assert rate_limited("x", 0.2).headers == {"Retry-After": "1"}
    assert rate_limited("x", 30.0).headers == {"Retry-After": "30"}
    assert rate_limited("x", 90.6).headers == {"Retry-After": "91"}
    err = rate_limited("x", 1.0)
    assert err.status == 429 and err.code == "rate_limit_exceeded"
