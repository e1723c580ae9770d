"""bench.hostile.transport's hostile driver against a live gateway with short deadlines."""

import time
from pathlib import Path

import pytest

from bench.fake_engine import InstantEngine
from bench.hostile.live import LiveServer
from bench.hostile.transport import Hostile, server_deadlines
from tests.gateway.live import LiveGateway

pytestmark = pytest.mark.slow


def test_every_hostile_connection_is_cut_off_and_a_bystander_is_served(tmp_path):
    with LiveGateway(
        InstantEngine("instant"),
        tmp_path / "data",
        header_timeout_seconds=0.5,
        body_timeout_seconds=0.5,
    ) as gw:
        key = gw.create_tenant("hostile")["api_key"]
        stop_at = time.monotonic() + 20  # far past the deadlines
        hostile = Hostile(gw.port, key, "instant", 4, stop_at).start()
        with gw.client() as c:
            assert c.get("/health").status_code == 200
        hostile.join()
        kinds = sorted(kind for kind, _ in hostile.outcomes)
        assert kinds == ["slow_body"] * 4 + ["slowloris"] * 4
        # each answered 408, or closed when a dribbled byte crossed the answer
        assert {how for _, how in hostile.outcomes} <= {"408", "closed"}
        totals = gw.protocol.table.totals
        assert totals["header_timeout"] == 4 and totals["body_timeout"] == 4


def test_server_deadlines_come_from_the_flags_else_the_defaults(tmp_path):
    flags = ["--header-timeout", "3", "--body-timeout", "4.5"]
    assert server_deadlines(LiveServer(tmp_path, Path("m"), flags)) == (3.0, 4.5)
    assert server_deadlines(LiveServer(tmp_path, Path("m"))) == (10.0, 20.0)


def test_never_read_streams_past_the_key_share_are_refused_and_the_rest_cut(tmp_path):
    """bench.hostile.never_read's driver against a live gateway: a table of 8 (a key's share:
    2), answers of ~6 MB that its sockets never read, a 1 s write deadline."""
    from bench.hostile.never_read import Parked
    from tests.gateway.transport_support import wait_for

    engine = InstantEngine(
        "instant", completion_tokens=150, token_text="x" * 5000, token_seconds=0.002
    )
    limits = {"max_connections": 8, "write_timeout_seconds": 1.0, "write_min_bytes_per_second": 0}
    with LiveGateway(engine, tmp_path / "data", **limits) as gw:
        key = gw.create_tenant("attacker")["api_key"]
        parked = Parked(gw.port, [key], "instant", 4).start()
        assert sorted(parked.statuses) == ["200", "200", "429", "429"]
        table = gw.protocol.table
        assert wait_for(lambda: table.totals.get("write_timeout") == 2)
        assert parked.finish() == ["cut", "cut"]
        assert table.totals["key_connection_limit"] == 2


def test_the_never_read_servers_flags_and_write_deadline(tmp_path):
    from bench.hostile.never_read import server_flags, write_timeout_of

    assert server_flags() == ["--max-connections", "32"]
    flags = server_flags(8)
    assert flags == ["--max-connections", "32", "--write-timeout", "8"]
    assert write_timeout_of(LiveServer(tmp_path, Path("m"), flags)) == 8.0
    assert write_timeout_of(LiveServer(tmp_path, Path("m"))) == 30.0
