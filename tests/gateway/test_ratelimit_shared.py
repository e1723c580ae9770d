"""Rate limits shared by several gateways through Redis (issue 18): the same token buckets as
the in-process limiter, enforced across limiters on one real ``redis-server``; leases of a
crashed gateway expire; Redis down means per-gateway limits, not none; then two live gateways
over one database and one Redis refuse the key's third request whichever serves it."""

import asyncio
import logging
import threading
import time

import pytest

from bench.fake_engine import InstantEngine
from loraplex.gateway.limits.ratelimit import RateLimitExceeded
from loraplex.gateway.limits.ratelimit_shared import SharedRateLimiter
from loraplex.gateway.services.tenants import TenantLimits
from tests.gateway.live import NO_LIMITS, LiveGateway
from tests.redis_server import redis_server

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def key(request):
    return f"key-{request.node.name}"  # a fresh key per test on the shared server


def run(body):
    return asyncio.run(body())


async def refused(limiter, key, limits) -> RateLimitExceeded:
    with pytest.raises(RateLimitExceeded) as info:
        await limiter.acquire(key, limits)
    return info.value


async def gateways(url, n=2, **kw):
    return [SharedRateLimiter(url, **kw) for _ in range(n)]


def test_requests_per_minute_are_one_bucket_across_gateways(redis_url, key):
    async def body():
        a, b = await gateways(redis_url)
        limits = TenantLimits(requests_per_minute=3)
        for limiter in (a, b, a):
            (await limiter.acquire(key, limits)).release(0)
        err = await refused(b, key, limits)
        assert err.limit == "requests_per_minute"
        assert 19.0 < err.retry_after <= 20.0  # one request refills in 60 / 3 s
        for limiter in (a, b):
            await limiter.close()

    run(body)


def test_tokens_are_charged_after_the_request_and_may_go_negative(redis_url, key):
    async def body():
        a, b = await gateways(redis_url)
        limits = TenantLimits(tokens_per_minute=600)  # 10 tokens/s
        ticket = await a.acquire(key, limits)
        ticket.release(1200)
        ticket.release(1200)  # idempotent
        await a.drain()
        err = await refused(b, key, limits)
        assert err.limit == "tokens_per_minute"
        assert 59.0 < err.retry_after <= 60.1  # from -600 back above 0 at 10/s
        for limiter in (a, b):
            await limiter.close()

    run(body)


def test_concurrency_is_counted_across_gateways_and_a_refusal_takes_nothing(redis_url, key):
    async def body():
        a, b = await gateways(redis_url)
        limits = TenantLimits(max_concurrent_requests=2, requests_per_minute=100)
        first = await a.acquire(key, limits)
        await b.acquire(key, limits)
        assert (await refused(a, key, limits)).limit == "max_concurrent_requests"
        assert await b.in_flight(key) == 2
        first.release(0)
        await a.drain()
        assert await b.in_flight(key) == 1
        await b.acquire(key, limits)
        assert await a.in_flight(key) == 2
        for limiter in (a, b):
            await limiter.close()

    run(body)


def test_limits_change_as_the_in_process_buckets_do(redis_url, key):
    async def body():
        (a,) = await gateways(redis_url, 1)
        for _ in range(30):  # None is unlimited
            (await a.acquire(key, TenantLimits())).release(10**6)
        (await a.acquire(key, TenantLimits(requests_per_minute=10))).release(0)  # starts full
        lowered = TenantLimits(requests_per_minute=2)  # 9 left, capped at 2
        for _ in range(2):
            (await a.acquire(key, lowered)).release(0)
        assert (await refused(a, key, lowered)).limit == "requests_per_minute"
        (await a.acquire(key + "-other", lowered)).release(0)  # keys are independent
        pttl = await a.redis.pttl(f"loraplex:rl:{{{key}}}:b")
        assert 60_000 < pttl <= 121_000  # an idle key's state goes once it would be full
        await a.close()

    run(body)


def test_a_crashed_gateways_leases_expire_and_a_live_ones_are_renewed(redis_url, key):
    async def body():
        crashed, live, other = await gateways(redis_url, 3, lease_seconds=1.0)
        limits = TenantLimits(max_concurrent_requests=1)
        await crashed.acquire(key, limits)
        crashed._renewer.cancel()  # the gateway is gone: nobody renews or releases
        assert (await refused(other, key, limits)).limit == "max_concurrent_requests"
        await asyncio.sleep(1.2)
        ticket = await live.acquire(key, limits)  # the lease expired
        await asyncio.sleep(2.0)  # twice the lease: renewed every 1/3 s while it runs
        assert (await refused(other, key, limits)).limit == "max_concurrent_requests"
        ticket.release(0)
        await live.drain()
        (await other.acquire(key, limits)).release(0)
        for limiter in (crashed, live, other):
            await limiter.close()

    run(body)


def test_a_held_ticket_keeps_its_lease_until_let_go(redis_url, key):
    """The connection holds the key's slot until the response is written or cut (issue 27),
    across gateways as in one."""

    async def body():
        a, b = await gateways(redis_url)
        limits = TenantLimits(max_concurrent_requests=1)
        ticket = await a.acquire(key, limits)
        let_go = ticket.hold()
        ticket.release(5)  # the engine is done; the answer is not written yet
        await a.drain()
        assert await b.in_flight(key) == 1
        assert (await refused(b, key, limits)).limit == "max_concurrent_requests"
        let_go()
        await a.drain()
        assert await b.in_flight(key) == 0
        (await b.acquire(key, limits)).release(0)
        for limiter in (a, b):
            await limiter.close()

    run(body)


def test_without_redis_each_gateway_limits_on_its_own(caplog):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def body():
        limiter = SharedRateLimiter(f"redis://:secret-pw@127.0.0.1:{port}/0", timeout_seconds=0.2)
        limits = TenantLimits(requests_per_minute=2)
        for _ in range(2):
            (await limiter.acquire("k", limits)).release(0)
        started = asyncio.get_running_loop().time()
        assert (await refused(limiter, "k", limits)).limit == "requests_per_minute"
        assert asyncio.get_running_loop().time() - started < 0.1  # Redis not waited on again
        assert limiter.fallback_admissions == 2  # the refused one was not admitted
        await limiter.close()

    with caplog.at_level(logging.WARNING, logger="loraplex.gateway.limits.ratelimit_shared"):
        run(body)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and f"127.0.0.1:{port}" in warnings[0]  # at most every 30 s
    assert "secret-pw" not in warnings[0]


def test_two_live_gateways_share_a_keys_limits(redis_url, tmp_path):
    """One database, one Redis, two gateways: the key's third request in the minute is a 429
    with ``Retry-After`` on either, and its concurrency slot is held across them."""
    gate = threading.Event()
    engine = InstantEngine("instant", completion_tokens=4, gate=gate)
    data = tmp_path / "data"
    kw = {**NO_LIMITS, "rate_limit_url": redis_url}
    body = {"model": "instant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        with LiveGateway(engine, data, **kw) as a, LiveGateway(engine, data, **kw) as b:
            tenant = a.create_tenant("shared")
            key = tenant["api_key"]
            with a.admin() as c:
                r = c.put(
                    f"/admin/tenants/{tenant['id']}/limits",
                    json={"requests_per_minute": 3, "max_concurrent_requests": 1},
                )
                assert r.status_code == 200, r.text

            def parked():
                with a.client(key) as c:
                    assert c.post("/v1/chat/completions", json=body).status_code == 200

            held = threading.Thread(target=parked)
            held.start()  # parked at the gate: holds the key's one slot
            deadline = time.monotonic() + 10
            while engine.in_flight == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            with b.client(key) as c:
                r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 429 and "max_concurrent_requests" in r.text
            gate.set()
            held.join(10)
            with b.client(key) as c:
                assert c.post("/v1/chat/completions", json=body).status_code == 200
            with a.client(key) as c:
                assert c.post("/v1/chat/completions", json=body).status_code == 200
                r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 429 and "requests_per_minute" in r.text
            assert int(r.headers["Retry-After"]) >= 1
            with b.client(key) as c:
                assert c.post("/v1/chat/completions", json=body).status_code == 429
            metrics = b.metrics()
            assert "\nloraplex_rate_limit_fallback_admissions_total 0.0\n" in metrics
    finally:
        gate.set()
