"""Transport limits against a real uvicorn server with the gateway's protocol, over raw sockets.

The gateway runs with :class:`bench.fake_engine.InstantEngine` behind
:func:`gateway.server.transport.uvicorn_config` (what ``serve`` runs), its timeouts configured
small. Every assertion is about what the server does (status, a closed connection, a slot not
held, another client answered), never about how long it took.
"""

import json
import socket
import threading
import time

import httpx
import pytest

from bench.fake_engine import InstantEngine
from tests.gateway.live import LiveGateway

SHORT = 0.5  # the header and body timeouts of these servers (s)
PATIENCE = 10.0  # how long a test waits for something the server must do


def connect(gw, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(
        ("127.0.0.1", gw.port), timeout=PATIENCE, source_address=(source, 0)
    )
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One whole response with a Content-Length body: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server has closed the connection (EOF or reset) within PATIENCE."""
    sock.settimeout(PATIENCE)
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def dribble_until_refused(sock: socket.socket, piece: bytes, every: float = 0.05) -> bytes:
    """Send ``piece`` every ``every`` s until the server answers or closes; returns its bytes.

    Fails when the server still reads after PATIENCE seconds (it never cut the dribble off).
    """
    sock.settimeout(every)
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            break
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return b""
        if data:
            sock.settimeout(PATIENCE)
            while True:
                try:
                    more = sock.recv(65536)
                except (ConnectionResetError, TimeoutError):
                    break
                if not more:
                    break
                data += more
            return data
        return b""
    else:
        pytest.fail("the server kept reading a dribbled request")
    return b""


def assert_408(raw: bytes, code: str) -> None:
    """A 408 with ``code``, or nothing: the answer lost to a reset (a byte sent after it)."""
    if raw:
        assert raw.startswith(b"HTTP/1.1 408 "), raw
        assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == code


def wait_for(predicate, timeout: float = PATIENCE) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def chat_json(text: str = "hi") -> bytes:
    body = {"model": "instant", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    return json.dumps(body).encode()


@pytest.fixture
def gw(tmp_path):
    engine = InstantEngine("instant")
    with LiveGateway(
        engine,
        tmp_path / "data",
        max_header_bytes=4096,
        max_headers=20,
        header_timeout_seconds=SHORT,
        body_timeout_seconds=SHORT,
        body_min_bytes_per_second=0,
        auth_max_failures=3,
        auth_failure_window_seconds=2.0,
        default_max_concurrent_requests=1,
    ) as live:
        yield live
    assert engine.in_flight == 0


def create_key(gw, name: str) -> tuple[str, str]:
    """A tenant's new key: (key id, key)."""
    tenant = gw.create_tenant(name)
    with gw.admin() as a:
        r = a.post(f"/admin/tenants/{tenant['id']}/keys")
        assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["api_key"]


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
    assert gw.state.limiter.in_flight(key_id) == 0
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


# ------------------------------------------------------------------------ failed-auth throttle
def client_from(gw, source: str, key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(base_url=gw.base_url, headers=headers, transport=transport, timeout=30)


def test_failed_auth_is_throttled_per_address_before_any_key_work(gw, monkeypatch):
    import gateway.server.auth as auth

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


# ---------------------------------------------------------------------------- open connections
def test_at_the_connection_cap_the_longest_idle_connection_makes_room(tmp_path):
    with LiveGateway(InstantEngine("instant"), tmp_path / "data", max_connections=4) as gw:
        idle = [connect(gw) for _ in range(4)]  # silent: no request running on any
        assert wait_for(lambda: gw.protocol.table.open == 4)
        with httpx.Client(base_url=gw.base_url, timeout=PATIENCE) as c:
            assert c.get("/health").status_code == 200  # a newcomer is served
        assert closed_by_server(idle[0])  # by closing the one that waited longest
        idle[1].settimeout(0.2)
        with pytest.raises(TimeoutError):
            idle[1].recv(1)  # the others stay open
        assert gw.protocol.table.totals["evicted"] == 1
        for sock in idle:
            sock.close()
        assert wait_for(lambda: gw.protocol.table.open == 0)


def test_when_every_connection_runs_a_request_a_newcomer_gets_503(tmp_path):
    gate = threading.Event()
    engine = InstantEngine("instant", gate=gate)
    with LiveGateway(engine, tmp_path / "data", max_connections=2) as gw:
        _, key = create_key(gw, "busy")
        statuses = []

        def chat():
            with httpx.Client(base_url=gw.base_url, timeout=PATIENCE) as c:
                r = c.post(
                    "/v1/chat/completions",
                    content=chat_json(),
                    headers={"Authorization": f"Bearer {key}"},
                )
                statuses.append(r.status_code)

        threads = [threading.Thread(target=chat) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            assert wait_for(lambda: engine.in_flight == 2)  # both connections run a request
            sock = connect(gw)
            status, headers, body = read_response(sock)
            assert status == 503 and headers["retry-after"] == "1"
            assert json.loads(body)["error"]["code"] == "connection_limit"
        finally:
            gate.set()
            for t in threads:
                t.join(PATIENCE)
        assert statuses == [200, 200]  # the running requests were never touched
        assert gw.protocol.table.totals["connection_limit"] == 1


# ------------------------------------------------------------------------ configuration
def test_serve_flags_reach_the_uvicorn_configuration(tmp_path):
    from gateway.cli import build_parser
    from gateway.commands.serve import gateway_config_from_args
    from gateway.server.transport import LimitedHttpProtocol, uvicorn_config

    argv = ["serve", "--data-dir", str(tmp_path), "--max-header-bytes", "2048"]
    argv += ["--max-headers", "12", "--header-timeout", "3", "--body-timeout", "7"]
    argv += ["--body-min-rate", "0", "--max-connections", "50", "--auth-max-failures", "4"]
    argv += ["--auth-failure-window", "30"]
    config = gateway_config_from_args(build_parser().parse_args(argv), "m")
    assert (config.max_header_bytes, config.max_headers, config.max_connections) == (2048, 12, 50)
    assert (config.header_timeout_seconds, config.body_timeout_seconds) == (3.0, 7.0)
    assert (config.body_min_bytes_per_second, config.auth_max_failures) == (0, 4)
    assert config.auth_failure_window_seconds == 30.0 and config.forwarded_allow_ips is None
    uv = uvicorn_config(object(), config)
    assert issubclass(uv.http, LimitedHttpProtocol)
    limits = uv.http.limits
    assert (limits.max_header_bytes, limits.max_headers, limits.max_connections) == (2048, 12, 50)
    assert (limits.header_timeout, limits.body_timeout, limits.body_min_rate) == (3.0, 7.0, 0)
    assert uv.proxy_headers is False and uv.ws == "none"
    defaults = gateway_config_from_args(build_parser().parse_args(["serve"]), "m")
    assert uvicorn_config(object(), defaults).http.limits.max_connections == 1024
    trusted = gateway_config_from_args(
        build_parser().parse_args(["serve", "--forwarded-allow-ips", "10.0.0.1"]), "m"
    )
    uv = uvicorn_config(object(), trusted)
    assert uv.proxy_headers is True and uv.forwarded_allow_ips == "10.0.0.1"


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-header-bytes", "0"],
        ["--max-headers", "-1"],
        ["--header-timeout", "nan"],
        ["--body-timeout", "0"],
        ["--max-connections", "0"],
        ["--body-min-rate", "-5"],
        ["--auth-max-failures", "-1"],
        ["--auth-failure-window", "0"],
    ],
)
def test_serve_refuses_limits_out_of_range(flags):
    from gateway.cli import build_parser
    from gateway.commands.serve import gateway_config_from_args

    with pytest.raises(ValueError, match=flags[0]):
        gateway_config_from_args(build_parser().parse_args(["serve", *flags]), "m")


def test_the_connection_cap_fits_the_open_files_limit(monkeypatch):
    import gateway.server.transport as transport

    limits = {"now": (400, 800)}
    monkeypatch.setattr(transport.resource, "getrlimit", lambda _: limits["now"])

    def setrlimit(_, value):
        if value[0] > value[1]:
            raise ValueError("over the hard limit")
        limits["now"] = value

    monkeypatch.setattr(transport.resource, "setrlimit", setrlimit)
    assert transport.fit_connection_cap(300, reserve=256) == 300  # soft raised to 556
    assert limits["now"] == (556, 800)
    assert transport.fit_connection_cap(1024, reserve=256) == 800 - 256  # the hard limit binds
    assert limits["now"] == (800, 800)


def test_time_the_server_itself_stops_reading_a_body_is_not_the_clients():
    """An app that reads its body late: uvicorn pauses reading past 64 KiB, the client waits."""
    import asyncio

    import uvicorn

    from gateway.server.transport import TransportLimits, limited_protocol
    from tests.gateway.live import free_port

    async def late_reader(scope, receive, send):
        if scope["type"] != "http":
            return
        await asyncio.sleep(4 * SHORT)  # busy elsewhere before it reads the body
        size, more = 0, True
        while more:
            message = await receive()
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        body = str(size).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    limits = TransportLimits(body_timeout=SHORT, body_min_rate=0)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            late_reader,
            port=port,
            http=limited_protocol(limits),
            loop="asyncio",
            lifespan="off",
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started)
        body = b"x" * (1024 * 1024)
        r = httpx.post(f"http://127.0.0.1:{port}/", content=body, timeout=PATIENCE)
        assert r.status_code == 200 and r.text == str(len(body))
        assert server.config.http.table.totals.get("body_timeout", 0) == 0
    finally:
        server.should_exit = True
        thread.join(PATIENCE)
