"""Header limits and read deadlines against a real uvicorn server with the gateway's protocol.

The gateway runs with :class:`bench.fake_engine.InstantEngine` behind
:func:`gateway.transport.uvicorn_config.uvicorn_config` (what ``serve`` runs), its timeouts
configured small, and is spoken to over raw sockets. Every assertion is about what the server does
(status, a closed connection, a slot not held, another client answered), never about how long
it took.
"""

import json
import threading
import time

import httpx
import pytest

from bench.fake_engine import InstantEngine
from tests.gateway.live import LiveGateway
from tests.gateway.transport_support import (
    PATIENCE,
    assert_408,
    chat_json,
    closed_by_server,
    connect,
    create_key,
    dribble_until_refused,
    read_response,
    small_limits_gateway,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def gw(tmp_path):
    with small_limits_gateway(tmp_path / "data") as live:
        yield live


# ------------------------------------------------------------------------------ header limits
def test_too_many_headers_is_431_and_closed(gw):
    sock = connect(gw)
    fields = b"".join(b"x-h%d: v\r\n" % i for i in range(21))
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + fields + b"\r\n")
    status, headers, body = read_response(sock)
    assert status == 431 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "header_too_large"
    assert closed_by_server(sock)
    # 20 fields (host included) are served
    sock = connect(gw)
    fields = b"".join(b"x-h%d: v\r\n" % i for i in range(19))
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + fields + b"\r\n")
    assert read_response(sock)[0] == 200
    assert gw.protocol.table.totals["header_too_large"] == 1


def test_header_bytes_over_the_cap_are_431(gw):
    sock = connect(gw)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 4100 + b"\r\n\r\n")
    status, _, body = read_response(sock)
    assert status == 431 and b"4096 bytes" in body
    assert closed_by_server(sock)
    # a URL counts too
    sock = connect(gw)
    sock.sendall(b"GET /health?" + b"q" * 4100 + b" HTTP/1.1\r\nhost: x\r\n\r\n")
    assert read_response(sock)[0] == 431
    # just under the cap is served
    sock = connect(gw)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 3900 + b"\r\n\r\n")
    assert read_response(sock)[0] == 200


def test_a_header_that_never_ends_is_refused_without_waiting_for_its_end(gw):
    sock = connect(gw)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-endless: ")
    sent = 0
    try:
        while sent < 1024 * 1024:  # far past 2 x 4096 + 4 x 20 raw bytes
            sock.sendall(b"a" * 1024)
            sent += 1024
            time.sleep(0.002)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert sent < 1024 * 1024, "the server kept reading a header without end"
    assert closed_by_server(sock)
    assert gw.protocol.table.totals["header_too_large"] == 1
    # too many fields in a head not yet complete: refused at once (431, not the 408 later);
    # the parser hands a field over when the next one begins: 22 lines are 21 fields
    sock = connect(gw)
    sock.sendall(b"GET /health HTTP/1.1\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(22)))
    status, _, body = read_response(sock)
    assert status == 431 and b"too many" in body


# ----------------------------------------------------------------------------- header timeout
def test_a_dribbled_head_gets_408_while_other_clients_are_answered(gw):
    slow = connect(gw)
    slow.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
    answered = []

    def bystander():
        with httpx.Client(base_url=gw.base_url, timeout=PATIENCE) as c:
            answered.append(c.get("/health").status_code)

    thread = threading.Thread(target=bystander)
    thread.start()
    raw = dribble_until_refused(slow, b"x")  # one byte of a header name each time
    thread.join(PATIENCE)
    assert answered == [200]
    assert_408(raw, "header_timeout")
    assert gw.protocol.table.totals["header_timeout"] == 1


def test_a_silent_connection_is_closed_without_an_answer(gw):
    sock = connect(gw)
    assert closed_by_server(sock)  # nothing was ever sent: closed, no 408 written
    assert wait_for(lambda: gw.protocol.table.open == 0)


def test_a_head_in_quick_pieces_and_idle_keep_alive_are_served(tmp_path):
    with LiveGateway(InstantEngine("instant"), tmp_path / "data", header_timeout_seconds=2.0) as gw:
        sock = connect(gw)
        for idle in (2.5, 0):  # idle between requests is keep-alive time, not head time
            for piece in (b"GET /hea", b"lth HTTP/1.1\r\nho", b"st: x\r\n", b"\r\n"):
                sock.sendall(piece)
                time.sleep(0.02)
            assert read_response(sock)[0] == 200
            time.sleep(idle)
        # two pipelined requests in one write are both answered
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" * 2)
        data = b""
        while data.count(b"HTTP/1.1 200 OK") < 2:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        assert gw.protocol.table.totals.get("header_timeout", 0) == 0


# ------------------------------------------------------------------------------- body timeout
def test_a_dribbled_body_gets_408_and_holds_no_concurrency_slot(gw):
    key_id, key = create_key(gw, "slow-body")  # one request at a time (the fixture's default)
    body = chat_json()
    slow = connect(gw)
    slow.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + key.encode() + b"\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body[:5]
    )
    # while the body dribbles, the key's only slot is free: its other request is served
    with httpx.Client(base_url=gw.base_url, timeout=PATIENCE) as c:
        r = c.post("/v1/chat/completions", content=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    # its slot is back once its response is written (just after the client may have read it)
    assert wait_for(lambda: gw.state.limiter.in_flight(key_id) == 0)
    raw = dribble_until_refused(slow, b" ")  # whitespace: valid JSON if it ever completed
    assert_408(raw, "body_timeout")
    assert gw.state.limiter.in_flight(key_id) == 0
    assert gw.protocol.table.totals["body_timeout"] == 1
    with httpx.Client(base_url=gw.base_url, timeout=PATIENCE) as c:  # and the key still works
        r = c.post("/v1/chat/completions", content=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200


def test_a_body_sent_faster_than_the_min_rate_may_take_longer_than_the_timeout(tmp_path):
    with LiveGateway(
        InstantEngine("instant"),
        tmp_path / "data",
        body_timeout_seconds=1.0,
        body_min_bytes_per_second=100,  # each 100 bytes earn 1 s
    ) as gw:
        _, key = create_key(gw, "steady")
        body = chat_json("hi " * 1300)  # about 4,000 bytes
        sock = connect(gw)
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"authorization: Bearer " + key.encode() + b"\r\n"
            b"content-length: %d\r\n\r\n" % len(body)
        )
        for i in range(0, len(body), 100):  # 100 bytes each 0.05 s: 20x the minimum rate
            sock.sendall(body[i : i + 100])
            time.sleep(0.05)
        status, _, _ = read_response(sock)
        assert status == 200
        assert gw.protocol.table.totals.get("body_timeout", 0) == 0


def test_a_body_still_sent_after_an_early_answer_is_cut_off(gw):
    sock = connect(gw)  # no key: 401 at once, while the client keeps sending its body
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n")
    status, _, _ = read_response(sock)
    assert status == 401
    sock.settimeout(0.05)
    deadline = time.monotonic() + PATIENCE
    closed = False
    while time.monotonic() < deadline and not closed:
        try:
            sock.sendall(b"x")
            closed = sock.recv(1) == b""
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            closed = True
    assert closed
    assert gw.protocol.table.totals["body_timeout"] == 1
