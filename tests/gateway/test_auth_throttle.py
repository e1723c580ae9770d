"""The failed-authentication throttle: under a fake clock, client groups, and a live gateway.

The live tests vary the client's address by connecting from 127.0.0.2, 127.0.0.3, ... (all
loopback on Linux).
"""

import pytest

from bench.fake_engine import InstantEngine
from loraplex.gateway.limits.auth_throttle import AuthThrottle, client_group
from tests.gateway.live import LiveGateway
from tests.gateway.transport_support import (
    client_from,
    create_key,
    small_limits_gateway,
    wait_for,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


def test_refused_after_max_failures_until_the_window_ends(clock):
    t = AuthThrottle(3, 60.0, clock=clock)
    for _ in range(2):
        t.failed("1.2.3.4")
        assert t.retry_after("1.2.3.4") is None
    clock.now += 10
    t.failed("1.2.3.4")
    assert t.retry_after("1.2.3.4") == pytest.approx(50.0)  # the window began at the first
    assert t.retry_after("5.6.7.8") is None  # nobody else is touched
    clock.now += 49.5
    assert t.retry_after("1.2.3.4") == pytest.approx(0.5)
    clock.now += 0.5
    assert t.retry_after("1.2.3.4") is None
    assert len(t) == 0  # a finished window is forgotten
    t.failed("1.2.3.4")  # a fresh window: one failure
    assert t.retry_after("1.2.3.4") is None


def test_failures_of_an_old_window_do_not_add_up(clock):
    t = AuthThrottle(2, 10.0, clock=clock)
    t.failed("a")
    clock.now += 10
    t.failed("a")
    assert t.retry_after("a") is None
    t.failed("a")
    assert t.retry_after("a") == pytest.approx(10.0)


def test_the_table_is_bounded_least_recently_failed_first(clock):
    t = AuthThrottle(1, 60.0, max_clients=3, clock=clock)
    for client in ("a", "b", "c"):
        t.failed(client)
    t.failed("a")  # a failed last now
    t.failed("d")
    assert len(t) == 3
    assert t.retry_after("b") is None  # evicted
    assert all(t.retry_after(c) is not None for c in ("a", "c", "d"))


def test_zero_failures_means_no_throttle(clock):
    t = AuthThrottle(0, 60.0, clock=clock)
    for _ in range(100):
        t.failed("a")
    assert t.retry_after("a") is None and len(t) == 0


@pytest.mark.parametrize(
    ("client", "group"),
    [
        (("192.0.2.7", 5000), "192.0.2.7"),
        (("2001:db8:1:2:aaaa:bbbb:cccc:dddd", 1), "2001:db8:1:2::/64"),
        (("2001:db8:1:2::1", 1), "2001:db8:1:2::/64"),
        (("2001:db8:1:3::1", 1), "2001:db8:1:3::/64"),
        (("::ffff:192.0.2.7", 1), "192.0.2.7"),
        (("fe80::1%eth0", 1), "fe80::/64"),
        (("testclient", 123), "testclient"),
        (None, ""),
    ],
)
def test_client_groups(client, group):
    assert client_group(client) == group


# ------------------------------------------------------------------------------ live gateway
@pytest.fixture
def gw(tmp_path):
    with small_limits_gateway(tmp_path / "data") as live:
        yield live


@pytest.mark.slow
def test_failed_auth_is_throttled_per_address_before_any_key_work(gw, monkeypatch):
    import loraplex.gateway.auth.middleware as auth

    _, key = create_key(gw, "honest")
    hashed = []
    real_hash = auth.hash_key
    monkeypatch.setattr(auth, "hash_key", lambda *a: hashed.append(1) or real_hash(*a))
    bad = "lpx-" + "0" * 40
    with client_from(gw, "127.0.0.2", bad) as guesser:
        assert [guesser.get("/v1/models").status_code for _ in range(3)] == [401] * 3
        assert len(hashed) == 3
        r = guesser.get("/v1/models")
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "too_many_failed_authentications"
        r = guesser.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 429  # even a good key from there: nothing is hashed meanwhile
        assert len(hashed) == 3
    with client_from(gw, "127.0.0.3", key) as other:  # another address is not affected
        assert other.get("/v1/models").status_code == 200
        assert (
            other.get("/v1/models", headers={"Authorization": f"Bearer {bad}"}).status_code == 401
        )
    with client_from(gw, "127.0.0.2", key) as guesser:  # after the window: served again
        assert wait_for(lambda: guesser.get("/v1/models").status_code == 200)


def test_forwarded_for_is_ignored_unless_a_proxy_is_trusted(gw):
    bad = "lpx-" + "1" * 40
    with client_from(gw, "127.0.0.4", bad) as c:
        for i in range(3):
            assert (
                c.get("/v1/models", headers={"X-Forwarded-For": f"10.0.0.{i}"}).status_code == 401
            )
        assert c.get("/v1/models", headers={"X-Forwarded-For": "10.0.0.9"}).status_code == 429


def test_a_trusted_proxy_forwards_the_client_address(tmp_path):
    with LiveGateway(
        InstantEngine("instant"),
        tmp_path / "data",
        auth_max_failures=2,
        forwarded_allow_ips="127.0.0.5",
    ) as gw:
        bad = "lpx-" + "2" * 40
        with client_from(gw, "127.0.0.5", bad) as proxy:
            for client in ("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"):
                r = proxy.get("/v1/models", headers={"X-Forwarded-For": client})
                assert r.status_code == 401
            assert (
                proxy.get("/v1/models", headers={"X-Forwarded-For": "10.0.0.1"}).status_code == 429
            )
            assert (
                proxy.get("/v1/models", headers={"X-Forwarded-For": "10.0.0.3"}).status_code == 401
            )
