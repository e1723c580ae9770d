"""Readers that never read (issue 27): the write deadline, the key's slot held until its
response is written or cut, stalled writers evicted under connection pressure, one key's share
of the connection table.

Every test drives a live gateway (uvicorn with ``LimitedHttpProtocol``) over real sockets.
A reader that never reads has a small receive buffer (``SO_RCVBUF`` 4 KiB) and asks for about
8 MB (``n`` 8 x 200 tokens of 5,000 characters, a token every 2 ms, so that a stream goes out
in many writes as a real engine's does): more than the kernel buffers on loopback (a few MB),
so the server's writes pause and stay paused.
"""

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

from bench.fake_engine import InstantEngine
from tests.gateway.chat_support import usage_events
from tests.gateway.live import LiveGateway
from tests.gateway.transport_support import (
    PATIENCE,
    closed_by_server,
    connect,
    create_key,
    read_response,
    wait_for,
)

pytestmark = pytest.mark.slow

TOKENS = 200
TOKEN_CHARS = 5000
TOKEN_SECONDS = 0.002
N = 8
WRITE_TIMEOUT = 1.0


@contextlib.contextmanager
def writes_gateway(data_dir, **overrides):
    """A live gateway over an instant engine whose answers are ~8 MB; one request per key."""
    engine = InstantEngine(
        "instant",
        completion_tokens=TOKENS,
        token_text="x" * TOKEN_CHARS,
        token_seconds=TOKEN_SECONDS,
    )
    config = dict(
        write_timeout_seconds=WRITE_TIMEOUT,
        write_min_bytes_per_second=0,
        default_max_concurrent_requests=1,
    )
    config.update(overrides)
    with LiveGateway(engine, data_dir, **config) as gw:
        yield gw
    assert engine.in_flight == 0


def big_request(key: str, *, stream: bool = True) -> bytes:
    body = {
        "model": "instant",
        "messages": [{"role": "user", "content": "hi"}],
        "n": N,
        "max_tokens": TOKENS,
        "stream": stream,
    }
    raw = json.dumps(body).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n" % (key.encode(), len(raw))
    )
    return head + raw


def never_read(gw, key: str, *, stream: bool = True, small: bool = True) -> socket.socket:
    """A connection that asks for ~8 MB and never reads a byte of it (``small``: through a
    4 KiB receive buffer)."""
    sock = socket.socket()
    if small:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.settimeout(PATIENCE)
    sock.connect(("127.0.0.1", gw.port))
    sock.sendall(big_request(key, stream=stream))
    return sock


def small_chat(gw, key: str) -> httpx.Response:
    body = {"model": "instant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with gw.client(key) as c:
        return c.post("/v1/chat/completions", json=body)


def tenant_of(gw, key: str) -> str:
    with gw.client(key) as c:
        return c.get("/v1/usage").json()["tenant"]


def last_row(gw, key: str):
    rows = usage_events(gw, key)
    assert rows, "no usage row"
    return rows[-1]


def test_a_stream_never_read_is_cut_at_the_write_deadline_and_billed_aborted(tmp_path):
    with writes_gateway(tmp_path / "data") as gw:
        key_id, key = create_key(gw, "parker")
        _, other = create_key(gw, "bystander")
        table, limiter = gw.protocol.table, gw.state.limiter
        sock = never_read(gw, key)
        assert wait_for(lambda: table.stalled() == 1)
        stalled_at = time.monotonic()
        # the engine is done (instant), but the key's one slot is held while the answer waits
        assert limiter.in_flight(key_id) == 1
        refused = small_chat(gw, key)
        assert refused.status_code == 429 and "max_concurrent_requests" in refused.text
        assert small_chat(gw, other).status_code == 200  # other tenants are served meanwhile
        assert wait_for(lambda: table.totals.get("write_timeout") == 1)
        waited = time.monotonic() - stalled_at
        assert WRITE_TIMEOUT - 0.2 <= waited <= WRITE_TIMEOUT + 3.0, waited
        assert closed_by_server(sock)  # reset: the client's unread bytes are dropped
        sock.close()
        assert wait_for(lambda: limiter.in_flight(key_id) == 0)  # the slot is back...
        assert small_chat(gw, key).status_code == 200  # ...and the key can chat again
        rows = usage_events(gw, key)
        cut = [row for row in rows if row.status != "ok"]
        assert len(rows) == 2 and len(cut) == 1
        assert (cut[0].status, cut[0].error_type) == ("aborted", "write_timeout")
        assert cut[0].completion_tokens == N * TOKENS  # every token the engine made is billed
        assert wait_for(lambda: table.open == 0) and table.stalled() == 0


def test_the_shared_limiter_holds_the_slot_of_a_stream_never_read_until_it_is_cut(tmp_path):
    """``--rate-limit-url``: the key's lease in Redis is held as the in-process slot is."""
    from tests.redis_server import redis_server

    (tmp_path / "redis").mkdir()
    with (
        redis_server(tmp_path / "redis") as url,
        writes_gateway(tmp_path / "data", rate_limit_url=url) as gw,
    ):
        _, key = create_key(gw, "shared-parker")
        table = gw.protocol.table
        sock = never_read(gw, key)
        assert wait_for(lambda: table.stalled() == 1)
        refused = small_chat(gw, key)  # the engine is done: only the unwritten answer holds it
        assert refused.status_code == 429 and "max_concurrent_requests" in refused.text
        assert wait_for(lambda: table.totals.get("write_timeout") == 1)
        sock.close()
        assert wait_for(lambda: small_chat(gw, key).status_code == 200)
        assert gw.state.limiter.fallback_admissions == 0  # every admission went through Redis
        statuses = [(row.status, row.error_type) for row in usage_events(gw, key)]
        assert statuses == [("aborted", "write_timeout"), ("ok", None)]


def test_a_json_answer_never_read_holds_its_slot_until_the_deadline_cuts_it(tmp_path):
    """A whole JSON answer is handed over in one write after its row is durable (``ok``); its
    key's slot is still held until the client takes it or the deadline cuts the connection."""
    with writes_gateway(tmp_path / "data") as gw:
        key_id, key = create_key(gw, "json-parker")
        table, limiter = gw.protocol.table, gw.state.limiter
        sock = never_read(gw, key, stream=False)
        assert wait_for(lambda: table.stalled() == 1)
        assert limiter.in_flight(key_id) == 1
        assert wait_for(lambda: table.totals.get("write_timeout") == 1)
        assert closed_by_server(sock)
        sock.close()
        assert wait_for(lambda: limiter.in_flight(key_id) == 0)
        row = last_row(gw, key)
        assert (row.status, row.completion_tokens) == ("ok", N * TOKENS)


def test_a_client_that_keeps_reading_is_never_cut(tmp_path):
    """Slower than the server writes, with pauses longer than the write timeout: each byte
    taken earns ``1 / write_min_rate`` s (the rate an honest slow reader keeps)."""
    with writes_gateway(
        tmp_path / "data", write_timeout_seconds=0.3, write_min_bytes_per_second=64 * 1024
    ) as gw:
        _, key = create_key(gw, "reader")
        table = gw.protocol.table
        sock = never_read(gw, key, small=False)
        received, stalls = bytearray(), 0
        while not received.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of the body
            chunk = sock.recv(32 * 1024)
            assert chunk, "the server closed a connection whose client was reading"
            received += chunk
            stalls += table.stalled()
            time.sleep(0.01)  # ~3 MB/s at most: the server's writes keep pausing
        sock.close()
        assert stalls > 0  # the writes did pause
        assert "write_timeout" not in table.totals
        assert received.count(b'"finish_reason":"length"') == N and b"data: [DONE]" in received
        assert last_row(gw, key).status == "ok"


def test_a_stalled_writer_is_evicted_for_a_newcomer_at_the_connection_cap(tmp_path):
    limits = {"max_connections": 2, "write_timeout_seconds": 60.0}
    with writes_gateway(tmp_path / "data", **limits) as gw:
        key_ids, keys = zip(*(create_key(gw, f"parker-{i}") for i in range(2)), strict=True)
        table, limiter = gw.protocol.table, gw.state.limiter
        first = never_read(gw, keys[0])
        assert wait_for(lambda: table.stalled() == 1)
        second = never_read(gw, keys[1])
        assert wait_for(lambda: table.stalled() == 2 and table.open == 2)
        time.sleep(gw.protocol.limits.stalled_after + 0.2)  # both stalled long enough
        with httpx.Client(base_url=gw.base_url, timeout=PATIENCE) as c:
            assert c.get("/health").status_code == 200  # a newcomer is served...
        assert closed_by_server(first)  # ...by resetting the writer stalled longest
        assert table.totals["evicted_stalled"] == 1 and "write_timeout" not in table.totals
        assert table.stalled() == 1 and table.held_by(key_ids[1]) == 1  # the other stays
        assert wait_for(lambda: limiter.in_flight(key_ids[0]) == 0)
        assert limiter.in_flight(key_ids[1]) == 1
        row = last_row(gw, keys[0])
        assert (row.status, row.error_type) == ("aborted", "evicted_stalled")
        first.close()
        second.close()
        assert wait_for(lambda: limiter.in_flight(key_ids[1]) == 0)


def test_a_key_past_its_connection_share_gets_429_and_others_are_served(tmp_path):
    limits = {
        "max_connections": 16,
        "max_connections_per_key": 2,
        "default_max_concurrent_requests": 8,
    }
    with writes_gateway(tmp_path / "data", **limits) as gw:
        key_id, key = create_key(gw, "hog")
        tenant = tenant_of(gw, key)
        _, other = create_key(gw, "bystander")
        table = gw.protocol.table
        parked = [never_read(gw, key) for _ in range(2)]
        assert wait_for(lambda: table.stalled() == 2 and table.held_by(key_id) == 2)
        sock = connect(gw)
        sock.sendall(big_request(key))
        status, headers, body = read_response(sock)
        assert status == 429 and headers["retry-after"] == "1"
        assert headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and error["type"] == "rate_limit_error"
        assert set(error) == {"message", "type", "param", "code"}
        assert closed_by_server(sock)
        sock.close()
        assert table.totals["key_connection_limit"] == 1 and table.held_by(key_id) == 2
        assert small_chat(gw, other).status_code == 200  # another key is not affected
        with gw.client() as c:
            assert c.get("/health").status_code == 200
        counted = gw.state.metrics.registry.get_sample_value(
            "loraplex_rate_limited_requests_total",
            {"tenant": tenant, "limit": "max_connections_per_key"},
        )
        assert counted == 1.0
        for s in parked:
            s.close()
        assert wait_for(lambda: table.held_by(key_id) == 0)
        assert small_chat(gw, key).status_code == 200  # its connections gone, the key is back


def test_at_its_share_a_keys_idle_connection_makes_room_for_its_next_one(tmp_path):
    limits = {"max_connections": 16, "max_connections_per_key": 2}
    with writes_gateway(tmp_path / "data", **limits) as gw:
        key_id, key = create_key(gw, "pooled")
        table = gw.protocol.table
        body = {"model": "instant", "messages": [{"role": "user", "content": "hi"}]}
        body["max_tokens"] = 1
        idle = []
        for _ in range(2):  # two keep-alive connections, idle after one request each
            sock = connect(gw)
            raw = json.dumps(body).encode()
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s"
                % (key.encode(), len(raw), raw)
            )
            assert read_response(sock)[0] == 200
            idle.append(sock)
        assert table.held_by(key_id) == 2
        assert small_chat(gw, key).status_code == 200  # a third connection: served
        assert closed_by_server(idle[0])  # the key's longest-idle one made room
        assert table.totals["evicted"] == 1 and "key_connection_limit" not in table.totals
        for sock in idle:
            sock.close()


def test_other_tenants_are_served_while_one_key_parks_streams_on_most_of_the_table(tmp_path):
    """The never-read-streams attack in small: one key parks streams on every connection it
    may hold; the table keeps room for everyone else."""
    limits = {"max_connections": 8, "write_timeout_seconds": 60.0}
    limits["default_max_concurrent_requests"] = 64
    with writes_gateway(tmp_path / "data", **limits) as gw:
        key_id, key = create_key(gw, "attacker")
        _, other = create_key(gw, "victim")
        table = gw.protocol.table
        share = gw.protocol.limits.key_share
        assert share == 2  # a quarter of 8
        parked = [never_read(gw, key) for _ in range(share + 3)]  # 3 more are refused
        assert wait_for(lambda: table.stalled() == share and table.held_by(key_id) == share)
        assert wait_for(lambda: table.totals.get("key_connection_limit") == 3)
        statuses = []

        def victim():
            for _ in range(5):
                statuses.append(small_chat(gw, other).status_code)
                with gw.client() as c:
                    statuses.append(c.get("/health").status_code)

        threads = [threading.Thread(target=victim) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PATIENCE)
        assert statuses == [200] * 20
        for s in parked:
            s.close()


def test_serve_flags_set_the_write_deadline_and_the_key_share(tmp_path):
    from loraplex.gateway.cli import build_parser
    from loraplex.gateway.commands.serve import gateway_config_from_args
    from loraplex.gateway.transport.uvicorn_config import uvicorn_config

    argv = ["serve", "--data-dir", str(tmp_path), "--write-timeout", "12.5"]
    argv += ["--write-min-rate", "0", "--max-connections", "40"]
    argv += ["--max-connections-per-key", "7"]
    config = gateway_config_from_args(build_parser().parse_args(argv), "m")
    assert (config.write_timeout_seconds, config.write_min_bytes_per_second) == (12.5, 0)
    assert config.max_connections_per_key == 7
    limits = uvicorn_config(object(), config).http.limits
    assert (limits.write_timeout, limits.write_min_rate, limits.key_share) == (12.5, 0, 7)
    defaults = gateway_config_from_args(build_parser().parse_args(["serve"]), "m")
    limits = uvicorn_config(object(), defaults).http.limits
    assert (limits.write_timeout, limits.write_min_rate) == (30.0, 1024)
    assert limits.key_share == limits.max_connections // 4 == 256
    assert uvicorn_config(object(), defaults).http.table.key_share == 256


@pytest.mark.parametrize(
    "flags",
    [
        ["--write-timeout", "0"],
        ["--write-timeout", "nan"],
        ["--write-min-rate", "-1"],
        ["--max-connections-per-key", "0"],
    ],
)
def test_serve_refuses_write_limits_out_of_range(flags):
    from loraplex.gateway.cli import build_parser
    from loraplex.gateway.commands.serve import gateway_config_from_args

    with pytest.raises(ValueError, match=flags[0]):
        gateway_config_from_args(build_parser().parse_args(["serve", *flags]), "m")
