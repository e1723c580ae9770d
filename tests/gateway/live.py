"""A real gateway on loopback for tests: uvicorn on a free port, in a background thread.

``LiveGateway`` builds the app around an engine client (tests share one engine per session, so
``owns_engine=False``), runs it with uvicorn on ``127.0.0.1:<free port>`` configured as ``serve``
configures it (:func:`gateway.transport.uvicorn_config.uvicorn_config`: the httptools protocol
with the connection limits), and stops it with a graceful shutdown (the same path as SIGINT
for ``loraplex serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn

from loraplex.gateway.db.session import db_url
from loraplex.gateway.server.build import build_gateway
from loraplex.gateway.server.config import GatewayConfig
from loraplex.gateway.server.metrics_listener import split_listeners
from loraplex.gateway.server.startup import bind_listeners
from loraplex.gateway.transport.uvicorn_config import uvicorn_config
from tests.support import free_port  # noqa: F401 - re-exported

ADMIN_KEY = "lpx-admin-test-key-0123456789abcdef0123456789"


class LiveGateway:
    """A running gateway.

    Attributes:
        base_url: ``http://127.0.0.1:<port>``.
        state: The app's :class:`GatewayState` (engine, store, usage writer, ...).
        admin_key: The admin key.
        metrics_url: ``http://127.0.0.1:<port>`` of the metrics listener
            (``metrics_listener=True``; ``serve --metrics-port``), else None.
        protocol: The server's HTTP protocol class (``protocol.table``: its connections and
            refusals).
    """

    def __init__(
        self,
        engine,
        data_dir: Path,
        *,
        db: str | None = None,
        owns_engine: bool = False,
        metrics_listener: bool = False,
        **config_overrides,
    ) -> None:
        self._sockets = None
        self.metrics_url = None
        if metrics_listener:  # both listeners bound now, as ``serve`` binds them
            self._sockets = bind_listeners("127.0.0.1", 0) + bind_listeners("127.0.0.1", 0)
            self.port = self._sockets[0].getsockname()[1]
            config_overrides["metrics_port"] = self._sockets[1].getsockname()[1]
            self.metrics_url = f"http://127.0.0.1:{config_overrides['metrics_port']}"
        else:
            self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.admin_key = ADMIN_KEY
        config = GatewayConfig(
            data_dir=Path(data_dir),
            db_url=db or db_url(data_dir),
            served_model_name=engine.model_name,
            port=self.port,
            **config_overrides,
        )
        self.app, self.state = build_gateway(
            config, engine, admin_key=ADMIN_KEY, owns_engine=owns_engine
        )
        self._server = uvicorn.Server(
            uvicorn_config(
                split_listeners(self.app, self.state),
                config,
                log_level="warning",
                lifespan="on",
                loop="asyncio",
                timeout_graceful_shutdown=5,
            )
        )
        self.protocol = self._server.config.http
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self._server.serve(self._sockets))

    def start(self) -> LiveGateway:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.state.draining = True  # as GracefulServer does on SIGINT / SIGTERM
        self._server.should_exit = True
        self._thread.join(30)
        for sock in self._sockets or ():
            sock.close()

    def __enter__(self) -> LiveGateway:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ helpers
    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60)

    def admin(self) -> httpx.Client:
        return self.client(self.admin_key)

    def metrics(self) -> str:
        """``GET /metrics`` with the admin key (the API port serves it to no other key)."""
        with self.admin() as c:
            r = c.get("/metrics")
        assert r.status_code == 200, r.text
        return r.text

    def create_tenant(self, name: str) -> dict:
        """``POST /admin/tenants`` -> ``{"id", "name", "api_key", "key_id"}``."""
        with self.admin() as c:
            r = c.post("/admin/tenants", json={"name": name})
            assert r.status_code == 201, r.text
            return r.json()

    def openai(self, key: str):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0)

    def kv_blocks_in_use(self) -> int:
        return int(self.state.engine.stats()["kv_blocks_in_use"])


NO_LIMITS = {
    "default_requests_per_minute": None,
    "default_tokens_per_minute": None,
    "default_max_concurrent_requests": None,
}


@contextlib.contextmanager
def instant_gateway(data_dir: Path, **engine_args) -> Iterator[LiveGateway]:
    """A live gateway over :class:`bench.fake_engine.InstantEngine`, no rate limits.

    After the block: no engine request is left in flight.
    """
    from bench.fake_engine import InstantEngine

    engine = InstantEngine("instant", **engine_args)
    with LiveGateway(engine, data_dir, **NO_LIMITS) as live:
        yield live
    assert engine.in_flight == 0
