"""The failed-authentication throttle under a fake clock, and how clients are grouped."""

import pytest

from gateway.server.auth_throttle import AuthThrottle, client_group


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
