"""bench.hostile.transport's hostile driver against a live gateway with short deadlines."""

import time
from pathlib import Path

from bench.fake_engine import InstantEngine
from bench.hostile.live import LiveServer
from bench.hostile.transport import Hostile, server_deadlines
from tests.gateway.live import LiveGateway


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
