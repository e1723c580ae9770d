"""A server whose engine dies does not sit half-dead: /health fails at once, requests get 503,
and ``GracefulServer`` (what ``loraplex serve`` runs) stops with exit code 1 (issue 13)."""

import threading
import time

import httpx
import pytest
import uvicorn

from loraplex.engine.config import EngineConfig
from loraplex.engine.core.engine_core import MAX_FAILING_STEPS
from loraplex.gateway.db.session import db_url
from loraplex.gateway.server.build import build_gateway, start_engine
from loraplex.gateway.server.config import GatewayConfig
from loraplex.gateway.transport.graceful import GracefulServer
from tests.gateway.live import ADMIN_KEY, free_port

pytestmark = pytest.mark.slow


def test_a_dead_engine_fails_health_and_the_server_exits_non_zero(tiny_text_dir, tmp_path):
    engine_config = EngineConfig(
        model=str(tiny_text_dir), served_model_name="tiny", num_kv_blocks=64
    )
    client = start_engine(engine_config, tmp_path / "s")
    port = free_port()
    config = GatewayConfig(
        data_dir=tmp_path / "data",
        db_url=db_url(tmp_path / "data"),
        served_model_name="tiny",
        port=port,
    )
    app, state = build_gateway(config, client, admin_key=ADMIN_KEY)
    server = GracefulServer(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"),
        state,
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        with httpx.Client(base_url=base, timeout=30) as c:
            key = c.post(
                "/admin/tenants",
                json={"name": "t"},
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            ).json()["api_key"]
            auth = {"Authorization": f"Bearer {key}"}
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            }
            assert c.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
            assert c.get("/health").status_code == 200

            def broken(items):
                raise RuntimeError("device lost")

            client.core.engine_core.runner.forward = broken
            statuses = [
                c.post("/v1/chat/completions", json=body, headers=auth).status_code
                for _ in range(MAX_FAILING_STEPS)
            ]
            # Each request failed alone until the engine gave up: then 503.
            assert statuses[:-1] == [500] * (MAX_FAILING_STEPS - 1) and statuses[-1] == 503
            assert not client.is_running
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        thread.join(30)
        assert not thread.is_alive() and server.exit_code == 1
    finally:
        server.should_exit = True
        thread.join(10)
        client.shutdown()
