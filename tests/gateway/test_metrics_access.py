"""Issue 27 item 5: who may read ``/metrics``, and the admin API's failed-auth throttle.

``/metrics`` names every tenant and its live counters, so the API port serves it to the admin
key only (401 without a key, 403 for a tenant key); ``serve --metrics-port`` adds a listener,
on loopback unless told otherwise, that serves ``GET /metrics`` without a key and nothing else.
Wrong admin keys count in the same per-address throttle as wrong tenant keys.
"""

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from bench.fake_engine import InstantEngine
from loraplex.gateway.cli import build_parser
from loraplex.gateway.commands.serve import _bind_metrics, gateway_config_from_args
from tests.gateway.live import NO_LIMITS, LiveGateway, free_port
from tests.gateway.test_app_basics import assert_openai_error
from tests.gateway.transport_support import client_from, small_limits_gateway, wait_for

pytestmark = pytest.mark.slow

CHAT = {"model": "instant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TENANT_SERIES = "loraplex_tenant_requests_total"


@pytest.fixture
def gw(tmp_path):
    """A gateway over the instant engine with the metrics listener, and two tenants' traffic."""
    with LiveGateway(
        InstantEngine("instant"), tmp_path / "data", metrics_listener=True, **NO_LIMITS
    ) as live:
        live.tenants = [live.create_tenant(name) for name in ("alpha", "beta")]
        for tenant in live.tenants:
            with live.client(tenant["api_key"]) as c:
                assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        yield live


def test_the_api_port_serves_metrics_to_the_admin_key_only(gw):
    alpha, beta = gw.tenants
    for key, status, code in (
        (None, 401, None),
        ("lpx-" + "0" * 40, 401, None),
        (alpha["api_key"], 403, "admin_only"),
    ):
        with gw.client(key) as c:
            r = c.get("/metrics")
            err = assert_openai_error(r, status, code)
            assert alpha["id"] not in r.text and beta["id"] not in r.text, err
    text = gw.metrics()
    for tenant in (alpha, beta):  # the operator keeps the per-tenant labels
        assert f'{TENANT_SERIES}{{status="ok",tenant="{tenant["id"]}"}} 1.0' in text


def test_the_metrics_listener_serves_metrics_without_a_key_and_nothing_else(gw):
    alpha, _ = gw.tenants
    with httpx.Client(base_url=gw.metrics_url, timeout=30) as m:
        r = m.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert r.text == gw.metrics()  # the same exposition as the admin's
        assert f'{TENANT_SERIES}{{status="ok",tenant="{alpha["id"]}"}} 1.0' in r.text
        head = m.head("/metrics")
        assert head.status_code == 200 and head.content == b""
        r = m.post("/metrics", content=b"{}")
        assert_openai_error(r, 405)
        assert r.headers["allow"] == "GET, HEAD"
        for path, key in (
            ("/v1/models", alpha["api_key"]),
            ("/admin/tenants", gw.admin_key),
            ("/health", None),
            ("/docs", alpha["api_key"]),
            ("/metrics/", None),
        ):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = m.get(path, headers=headers)
            assert_openai_error(r, 404, "not_found")
        r = m.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer x"})
        assert_openai_error(r, 404)
    with gw.client(alpha["api_key"]) as c:  # the API port is unchanged
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert_openai_error(c.get("/metrics"), 403)


def test_serve_flags_and_binding(tmp_path):
    parser = build_parser()
    config = gateway_config_from_args(parser.parse_args(["serve"]), "m")
    assert (config.metrics_host, config.metrics_port) == ("127.0.0.1", None)
    args = parser.parse_args(["serve", "--metrics-port", "9464", "--metrics-host", "10.0.0.1"])
    config = gateway_config_from_args(args, "m")
    assert (config.metrics_host, config.metrics_port) == ("10.0.0.1", 9464)

    def bind(metrics_port, port=8000, host="127.0.0.1", api_port=None):
        """``_bind_metrics`` for ``--port port`` (bound as ``api_port``); closed again."""
        sockets = []
        args = argparse.Namespace(metrics_port=metrics_port, metrics_host=host, port=port)
        bound = port if api_port is None else api_port
        try:
            return _bind_metrics(args, bound, sockets), [s.getsockname() for s in sockets]
        finally:
            for s in sockets:
                s.close()

    assert bind(None) == (None, [])
    port, names = bind(0)
    assert names == [("127.0.0.1", port)] and port not in (0, 8000)
    for bad in (-1, 65536, 8000):
        with pytest.raises(OSError, match="differ from --port"):
            bind(bad)
    api = socket.create_server(("127.0.0.1", 0))  # the API on one address ...
    try:
        taken = api.getsockname()[1]
        with pytest.raises(OSError, match="the API listens on the same port"):
            bind(taken, port=0, host="127.0.0.2", api_port=taken)  # ... another: refused
        with pytest.raises(OSError, match="in use"):
            bind(taken, port=0)
    finally:
        api.close()


# ------------------------------------------------------------------ the admin key's throttle
@pytest.fixture
def throttled(tmp_path):
    """3 failed authentications per address within 2 s, then 429 until the window ends."""
    with small_limits_gateway(tmp_path / "data") as live:
        yield live


@pytest.mark.parametrize("path", ["/admin/tenants", "/metrics"])
def test_wrong_admin_keys_are_throttled_per_address(throttled, path):
    gw = throttled
    wrong = "not-the-admin-key-" + "x" * 24
    method = "POST" if path == "/admin/tenants" else "GET"
    body = {"json": {"name": f"t{time.monotonic_ns()}"}} if method == "POST" else {}
    with client_from(gw, "127.0.0.2", wrong) as guesser:
        for _ in range(3):
            assert_openai_error(guesser.request(method, path, **body), 401)
        r = guesser.request(method, path, **body)
        assert_openai_error(r, 429, "too_many_failed_authentications")
        assert 1 <= int(r.headers["Retry-After"]) <= 2
        headers = {"Authorization": f"Bearer {gw.admin_key}"}
        r = guesser.get("/admin/tenants/x", headers=headers)  # the right key, same address
        assert_openai_error(r, 429, "too_many_failed_authentications")
    with client_from(gw, "127.0.0.3", gw.admin_key) as admin:  # another address: unaffected
        assert admin.get(path).status_code == 200
        assert_openai_error(admin.get("/admin/tenants/x"), 404)
    with client_from(gw, "127.0.0.2", gw.admin_key) as admin:  # after the window: served
        assert wait_for(lambda: admin.get(path).status_code == 200)


# ------------------------------------------------------------------------ a real `serve`
def test_serve_with_a_metrics_listener(llava_dir, tmp_path):
    data, port, metrics_port = tmp_path / "data", free_port(), free_port()
    exe = shutil.which("loraplex")
    cmd = [exe] if exe else [sys.executable, "-m", "loraplex.gateway.cli"]
    cmd += ["serve", "--model", str(llava_dir), "--served-model-name", "tiny-llava"]
    cmd += ["--data-dir", str(data), "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    same = subprocess.run(
        [*cmd, "--metrics-port", str(port)], capture_output=True, text=True, env=env, timeout=60
    )
    assert same.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} for metrics" in same.stderr
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, "--metrics-port", str(metrics_port), "--num-kv-blocks", "64"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        api, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"

        def healthy():
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"{api}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_for(healthy, timeout=120), log.read_text()
        assert f"metrics listener {metrics_url}/metrics is ours" in log.read_text()
        admin = {"Authorization": f"Bearer {(data / 'admin.key').read_text().strip()}"}
        tenant = httpx.post(f"{api}/admin/tenants", json={"name": "acme"}, headers=admin).json()
        key = {"Authorization": f"Bearer {tenant['api_key']}"}
        chat = {**CHAT, "model": "tiny-llava", "max_tokens": 1}
        assert httpx.post(f"{api}/v1/chat/completions", json=chat, headers=key).status_code == 200
        text = httpx.get(f"{metrics_url}/metrics").text
        assert f'{TENANT_SERIES}{{status="ok",tenant="{tenant["id"]}"}} 1.0' in text
        assert httpx.get(f"{api}/metrics").status_code == 401
        assert httpx.get(f"{api}/metrics", headers=key).status_code == 403
        assert httpx.get(f"{api}/metrics", headers=admin).status_code == 200
        assert httpx.get(f"{metrics_url}/v1/models", headers=key).status_code == 404
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, log.read_text()
