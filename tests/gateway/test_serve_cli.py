"""``loraplex serve`` as a real process: admin key location, /health, graceful SIGINT.

One process (a start costs several seconds of imports and model loading): it serves a chat, gets
SIGINT while a long stream is in flight, lets that stream finish, flushes usage and exits 0.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from sqlalchemy import select

from loraplex.gateway.db.models import UsageEvent
from loraplex.gateway.db.session import db_url
from tests.gateway.conftest import with_db
from tests.gateway.live import free_port

pytestmark = pytest.mark.slow

START_TIMEOUT = 90
EXIT_TIMEOUT = 10


class Serve:
    """``loraplex serve --model DIR --data-dir DATA --port P`` with its stderr in a file."""

    def __init__(self, model, data, log_path, log_level="warning"):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        exe = shutil.which("loraplex")
        cmd = [exe] if exe else [sys.executable, "-m", "loraplex.gateway.cli"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd
            + ["serve", "--model", str(model), "--data-dir", str(data)]
            + ["--port", str(self.port), "--num-kv-blocks", "64", "--log-level", log_level]
            + ["--shutdown-grace", "20"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def wait_healthy(self) -> httpx.Response:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(f"{self.base_url}/health", timeout=2)
                if r.status_code == 200:
                    return r
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail(f"serve did not become healthy:\n{self.log()}")


@pytest.fixture
def serve_factory(llava_dir, tmp_path):
    started = []

    def start(data, name="serve", log_level="warning"):
        s = Serve(llava_dir, data, tmp_path / f"{name}.log", log_level)
        started.append(s)
        return s

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
        s._log.close()


async def _tenant_ids(sessions):
    from loraplex.gateway.db.models import Tenant

    async with sessions() as session:
        return list(await session.scalars(select(Tenant.id)))


async def _usage_rows(sessions):
    async with sessions() as session:
        return list(await session.scalars(select(UsageEvent).order_by(UsageEvent.id)))


def test_serve_prints_the_admin_key_location_and_drains_on_sigint(serve_factory, tmp_path):
    data = tmp_path / "data"
    serve = serve_factory(data, log_level="info")  # the default: with the access log
    assert serve.wait_healthy().json() == {"status": "ok"}
    key_path = data / "admin.key"
    assert f"admin key written to {key_path}" in serve.log()
    assert "loraplex: KV pool of 64 blocks (16 tokens each, 1024 tokens) = " in serve.log()
    assert oct(key_path.stat().st_mode & 0o777) == "0o600"
    admin_key = key_path.read_text().strip()

    with httpx.Client(base_url=serve.base_url, timeout=60) as c:
        r = c.post(
            "/admin/tenants",
            json={"name": "acme"},
            headers={"Authorization": f"Bearer {admin_key}"},
        )
        assert r.status_code == 201, r.text
        key = r.json()["api_key"]
        auth = {"Authorization": f"Bearer {key}"}
        hi = [{"role": "user", "content": "Say hello."}]
        r = c.post(
            "/v1/chat/completions",
            json={"model": "llava", "messages": hi, "max_tokens": 3},
            headers=auth,
        )
        assert r.status_code == 200, r.text
        seen = [r.json()["usage"]["completion_tokens"]]
        r = c.get(f"/v1/models?api_key={key}", headers=auth)  # a key where it does not belong
        assert r.status_code == 200, r.text

        # A long stream in flight when SIGINT arrives: it is allowed to finish (grace period).
        body = {
            "model": "llava",
            "messages": hi,
            "max_tokens": 200,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with c.stream("POST", "/v1/chat/completions", json=body, headers=auth) as s:
            assert s.status_code == 200
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            start = time.monotonic()
            serve.proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        seen.append(json.loads(rest[-2][len("data: ") :])["usage"]["completion_tokens"])

    try:
        serve.proc.wait(EXIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve did not exit within {EXIT_TIMEOUT} s of SIGINT:\n{serve.log()}")
    assert serve.proc.returncode == 0, serve.log()
    assert time.monotonic() - start < EXIT_TIMEOUT + 5
    assert "Traceback" not in serve.log(), serve.log()
    log = serve.log()
    assert admin_key not in log and key not in log  # locations, never keys

    # The access log: a line per request, the last one written at shutdown; keys masked.
    tenant = with_db(db_url(data), _tenant_ids)[0]
    access = [line for line in log.splitlines() if line.startswith("INFO:     127.0.0.1:")]
    targets = [(line.split('"')[1], line.split('" ')[1].split()[0]) for line in access]
    assert ("POST /admin/tenants HTTP/1.1", "201") in targets
    assert targets.count(("POST /v1/chat/completions HTTP/1.1", "200")) == 2, access
    (models,) = [line for line in access if "/v1/models" in line]
    assert "api_key=lpx-" in models and "***" in models and f"tenant={tenant}" in models

    # Usage was flushed by the shutdown: both requests, as the client saw them.
    rows = with_db(db_url(data), _usage_rows)
    assert [(r.status, r.completion_tokens) for r in rows] == [("ok", n) for n in seen]
