"""The connection cap, uvicorn configuration and serve flags, deadlines against flow control."""

import asyncio
import json
import threading

import httpx
import pytest

from bench.fake_engine import InstantEngine
from tests.gateway.live import LiveGateway
from tests.gateway.transport_support import (
    PATIENCE,
    SHORT,
    chat_json,
    closed_by_server,
    connect,
    create_key,
    read_response,
    wait_for,
)

pytestmark = pytest.mark.slow


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
    limits = {"max_connections": 2, "max_connections_per_key": 2}  # one key on both
    with LiveGateway(engine, tmp_path / "data", **limits) as gw:
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
    from loraplex.gateway.cli import build_parser
    from loraplex.gateway.commands.serve import gateway_config_from_args
    from loraplex.gateway.transport.http_protocol import LimitedHttpProtocol
    from loraplex.gateway.transport.uvicorn_config import uvicorn_config

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
    from loraplex.gateway.cli import build_parser
    from loraplex.gateway.commands.serve import gateway_config_from_args

    with pytest.raises(ValueError, match=flags[0]):
        gateway_config_from_args(build_parser().parse_args(["serve", *flags]), "m")


def test_the_connection_cap_fits_the_open_files_limit(monkeypatch):
    import loraplex.gateway.transport.uvicorn_config as transport

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

    import uvicorn

    from loraplex.gateway.transport.http_protocol import limited_protocol
    from loraplex.gateway.transport.limits import TransportLimits
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
