"""Per-key rate limits: the token buckets under a fake clock, then 429s from a live gateway."""

import threading

import openai
import pytest

from loraplex.gateway.errors import rate_limited
from loraplex.gateway.limits.ratelimit import RateLimiter, RateLimitExceeded
from loraplex.gateway.services.tenants import TenantLimits
from tests.gateway.live import instant_gateway
from tests.gateway.test_app_basics import assert_openai_error


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


def test_a_held_ticket_keeps_its_slot_until_released_and_let_go(limiter, clock):
    """The connection holds the key's slot until the response is written or cut (issue 27):
    released first or let go first, the slot comes back (and the tokens are charged) once."""
    limits = TenantLimits(tokens_per_minute=60, max_concurrent_requests=1)
    ticket = limiter.admit("k", limits)
    let_go = ticket.hold()
    ticket.release(30)  # the engine is done, the usage row written
    assert limiter.in_flight("k") == 1 and not ticket.released
    assert refused(limiter, "k", limits).limit == "max_concurrent_requests"
    let_go()  # the response is written
    let_go()
    assert limiter.in_flight("k") == 0 and ticket.released
    other = limiter.admit("k", limits)  # 60 - 30: admitted, the tokens charged once
    let_go = other.hold()
    let_go()  # cut before the request ended: the slot waits for its release
    assert limiter.in_flight("k") == 1
    other.release(31)
    assert limiter.in_flight("k") == 0
    assert refused(limiter, "k", limits).limit == "tokens_per_minute"  # 30 - 31 < 0


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


# --------------------------------------------------------------------------- live gateway
# The real app over an instant fake engine (bench.fake_engine): rate limits are the gateway's
# alone, and a gate holds requests in flight for exactly as long as a test needs.


@pytest.fixture
def gate():
    event = threading.Event()
    yield event
    event.set()  # never leave a request parked


@pytest.fixture
def gw(gate, tmp_path):
    with instant_gateway(tmp_path / "data", completion_tokens=8, gate=gate) as live:
        yield live


def chat(gw, key, **extra):
    body = {"model": "instant", "messages": [{"role": "user", "content": "hello there"}]}
    body |= {"max_tokens": 4, **extra}
    with gw.client(key) as c:
        return c.post("/v1/chat/completions", json=body)


def set_limits(gw, tenant_id, **limits):
    with gw.admin() as a:
        r = a.put(f"/admin/tenants/{tenant_id}/limits", json=limits)
        assert r.status_code == 200, r.text
        return r.json()


def usage_requests(gw, key):
    with gw.client(key) as c:
        return c.get("/v1/usage").json()["totals"]["requests"]


def test_limits_are_per_key_with_the_refill_time_as_retry_after(gw, gate):
    gate.set()
    tenant = gw.create_tenant("per-key")
    set_limits(gw, tenant["id"], requests_per_minute=1)
    first = tenant["api_key"]
    assert chat(gw, first).status_code == 200
    r = chat(gw, first)
    err = assert_openai_error(r, 429, "rate_limit_exceeded")
    assert err["type"] == "rate_limit_error" and "requests_per_minute" in err["message"]
    assert r.headers["Retry-After"] == "60"  # one request per minute refills in 60 s
    with gw.admin() as a:
        second = a.post(f"/admin/tenants/{tenant['id']}/keys").json()["api_key"]
    assert chat(gw, second).status_code == 200  # the other key has its own bucket
    assert chat(gw, second).status_code == 429
    assert usage_requests(gw, first) == 2  # refused requests leave no usage row


def test_a_limit_set_on_a_key_that_was_unlimited_starts_full(limiter, clock):
    limiter.admit("k", TenantLimits()).release(0)
    clock.advance(1.0)
    limiter.admit("k", TenantLimits(requests_per_minute=2)).release(0)
    limiter.admit("k", TenantLimits(requests_per_minute=2)).release(0)
    assert refused(limiter, "k", TenantLimits(requests_per_minute=2)).retry_after > 0


def test_a_lowered_limit_caps_the_bucket(limiter):
    limiter.admit("k", TenantLimits(requests_per_minute=600)).release(0)
    limiter.admit("k", TenantLimits(requests_per_minute=1)).release(0)
    refused(limiter, "k", TenantLimits(requests_per_minute=1))


def test_new_limits_apply_at_once_to_a_key_already_in_use(gw, gate):
    gate.set()
    tenant = gw.create_tenant("changing")
    key = tenant["api_key"]
    for _ in range(3):
        assert chat(gw, key).status_code == 200  # server defaults: unlimited
    view = set_limits(gw, tenant["id"], requests_per_minute=1)
    assert view["effective_limits"]["requests_per_minute"] == 1
    assert chat(gw, key).status_code == 200
    assert chat(gw, key).status_code == 429
    set_limits(gw, tenant["id"], requests_per_minute=None)  # back to the default: unlimited
    assert chat(gw, key).status_code == 200


def test_tokens_per_minute_charges_what_a_request_used(gw, gate):
    gate.set()
    tenant = gw.create_tenant("tokens")
    key = tenant["api_key"]
    set_limits(gw, tenant["id"], tokens_per_minute=6)
    r = chat(gw, key, max_tokens=8)  # admitted: the bucket is positive before it runs
    assert r.status_code == 200
    used = r.json()["usage"]["total_tokens"]
    assert used > 6
    r = chat(gw, key)
    err = assert_openai_error(r, 429, "rate_limit_exceeded")
    assert "tokens_per_minute" in err["message"]
    # the bucket is at 6 - used; back above zero at 6 tokens a minute: (1 + used - 6) * 10 s
    expected = (1 + used - 6) * 10
    assert expected - 2 <= int(r.headers["Retry-After"]) <= expected


def test_concurrency_limit_with_overlapping_streams(gw, gate):
    tenant = gw.create_tenant("one-at-a-time")
    key = tenant["api_key"]
    set_limits(gw, tenant["id"], max_concurrent_requests=1)
    client = gw.openai(key)
    messages = [{"role": "user", "content": "count"}]
    held = client.chat.completions.create(
        model="instant", messages=messages, max_tokens=4, stream=True
    )
    first = next(iter(held))  # the first chunk is out; the engine is parked at the gate
    assert first.choices[0].delta.role == "assistant"
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(
            model="instant", messages=messages, max_tokens=4, stream=True
        )
    assert info.value.response.headers["Retry-After"]
    assert info.value.body["code"] == "rate_limit_exceeded"
    assert "max_concurrent_requests" in info.value.body["message"]
    gate.set()
    text = "".join(c.choices[0].delta.content or "" for c in held if c.choices)
    assert text == "ok " * 4
    again = client.chat.completions.create(model="instant", messages=messages, max_tokens=2)
    assert again.usage.completion_tokens == 2


def test_failed_requests_free_their_slot(gw, gate):
    gate.set()
    tenant = gw.create_tenant("failing")
    key = tenant["api_key"]
    set_limits(gw, tenant["id"], max_concurrent_requests=1)
    with gw.client(key) as c:
        for bad in ({"model": "instant"}, {"model": "nope", "messages": [{"role": "user"}]}):
            assert c.post("/v1/chat/completions", json=bad).status_code in (400, 404)
        r = c.post("/v1/chat/completions", content=b"{not json")
        assert_openai_error(r, 400)
    assert chat(gw, key).status_code == 200
    assert gw.state.limiter.in_flight(_key_id(gw, key)) == 0


def _key_id(gw, key):
    with gw.admin() as a:
        tenants = a.get("/admin/tenants").json()["data"]
        for t in tenants:
            for k in a.get(f"/admin/tenants/{t['id']}").json()["keys"]:
                if key.startswith(k["prefix"]):
                    return k["id"]
    raise AssertionError("key not found")
