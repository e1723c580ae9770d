"""Raw-socket helpers for the transport tests: a gateway with small limits, HTTP by hand."""

import contextlib
import json
import socket
import time

import httpx
import pytest

from bench.fake_engine import InstantEngine
from tests.gateway.live import LiveGateway
from tests.support import wait_for  # noqa: F401 - re-exported

SHORT = 0.5  # the header and body timeouts of these servers (s)
PATIENCE = 10.0  # how long a test waits for something the server must do


@contextlib.contextmanager
def small_limits_gateway(data_dir, **overrides):
    """A live gateway over the instant engine with small transport and auth limits."""
    engine = InstantEngine("instant")
    config = dict(
        max_header_bytes=4096,
        max_headers=20,
        header_timeout_seconds=SHORT,
        body_timeout_seconds=SHORT,
        body_min_bytes_per_second=0,
        auth_max_failures=3,
        auth_failure_window_seconds=2.0,
        default_max_concurrent_requests=1,
    )
    config.update(overrides)
    with LiveGateway(engine, data_dir, **config) as live:
        yield live
    assert engine.in_flight == 0


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


def chat_json(text: str = "hi") -> bytes:
    body = {"model": "instant", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    return json.dumps(body).encode()


def create_key(gw, name: str) -> tuple[str, str]:
    """A tenant's new key: (key id, key)."""
    tenant = gw.create_tenant(name)
    with gw.admin() as a:
        r = a.post(f"/admin/tenants/{tenant['id']}/keys")
        assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["api_key"]


def client_from(gw, source: str, key: str | None = None) -> httpx.Client:
    """A client whose connections come from ``source`` (127.0.0.x: another peer address)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(base_url=gw.base_url, headers=headers, transport=transport, timeout=30)
