"""Usage rows lost when the server is killed, or when its database goes away (issue 13, item 6).

Both parts drive a real ``loraplex serve`` (:class:`bench.hostile.live.LiveServer`, the
built-in tiny model) with closed-loop clients (half streamed, half not) and keep, for every
response a client received whole (the JSON body, or a stream through ``data: [DONE]`` with no
error event), its id and completion tokens. Afterwards every such id must have its usage row
with those tokens (read from the database itself, after ``GET /v1/usage`` has flushed the
writer); a received response without its row is a row lost.

- :func:`sigkill_loss`: SIGKILL at a random moment of the load, restart on the same data
  directory, again while the time budget lasts (SQLite).
- :func:`db_outage_loss`: PostgreSQL behind a :class:`bench.hostile.tcp_proxy.TcpProxy`; the
  proxy is cut during the load, the server is stopped (SIGTERM) while the database is still
  down, the database comes back and the server is started again. Also counts 500s (there must
  be none) and how the outage was answered (served and spooled, or 503). Needs
  ``LORAPLEX_BENCH_PG_URL`` or ``LORAPLEX_TEST_PG_URL`` (a database it may wipe); returns a note
  instead of a figure when none is reachable.

Run: ``python -m bench.hostile.usage [--quick]`` (prints a table, then one JSON line). Each part
takes under a minute once its server is up; a ``loraplex serve`` start (imports, the tiny model)
is 15-30 s of that on 2 busy cores, so ``--quick`` kills once.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.hostile.live import LiveServer, init_tiny

NO_LIMITS = ["--requests-per-minute", "100000000", "--tokens-per-minute", "1000000000"]
NO_LIMITS += ["--max-concurrent-requests", "100000"]
MAX_TOKENS = 6


class Load:
    """Closed-loop clients against one server until :meth:`stop`; tolerant of its death.

    Attributes:
        received: Response id -> completion tokens, for every response received whole.
        statuses: HTTP status -> count (``"transport"`` for a broken connection).
    """

    def __init__(self, base_url: str, key: str, model: str, clients: int, seed: int) -> None:
        self.base_url, self.key, self.model = base_url, key, model
        self.received: dict[str, int] = {}
        self.statuses: Counter = Counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(seed * 1000 + i,), daemon=True)
            for i in range(clients)
        ]

    def start(self) -> Load:
        """Start the clients."""
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop the clients (each ends its request in flight first)."""
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.base_url, headers=headers, timeout=30) as client:
            while not self._stop.is_set():
                stream = rng.random() < 0.5
                body = {
                    "model": self.model,
                    "messages": [{"role": "user", "content": f"count to {rng.randrange(99)}"}],
                    "max_tokens": rng.randint(1, MAX_TOKENS),
                    "stream": stream,
                }
                try:
                    status, rid, tokens = _one(client, body)
                except httpx.HTTPError:
                    status, rid, tokens = "transport", None, 0
                    time.sleep(0.05)  # the server is down: do not spin
                with self._lock:
                    self.statuses[status] += 1
                    if rid is not None:
                        self.received[rid] = tokens


def _one(client: httpx.Client, body: dict[str, Any]) -> tuple[int, str | None, int]:
    """One request: (status, response id if received whole, completion tokens)."""
    if not body["stream"]:
        r = client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return r.status_code, None, 0
        data = r.json()
        return 200, data["id"], data["usage"]["completion_tokens"]
    body = {**body, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, None, 0
        rid, tokens, done = None, 0, False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return 200, None, 0  # not a whole answer
            rid = chunk["id"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        return 200, (rid if done else None), tokens


def stored_rows(url: str, tenant_id: str) -> dict[str, int]:
    """``request_id -> completion_tokens`` of the tenant's usage rows, read from the database."""
    from sqlalchemy import select

    from loraplex.gateway.db.models import UsageEvent
    from loraplex.gateway.db.session import make_engine

    async def main() -> dict[str, int]:
        engine = make_engine(url)
        try:
            async with engine.connect() as conn:
                rows = await conn.execute(
                    select(UsageEvent.request_id, UsageEvent.completion_tokens).where(
                        UsageEvent.tenant_id == tenant_id
                    )
                )
                return {rid: tokens for rid, tokens in rows}
        finally:
            await engine.dispose()

    return asyncio.run(main())


def compare(received: dict[str, int], rows: dict[str, int]) -> dict[str, int]:
    """What clients received against what was recorded."""
    lost = [rid for rid in received if rid not in rows]
    wrong = [rid for rid in received if rid in rows and rows[rid] != received[rid]]
    return {
        "responses_received": len(received),
        "usage_rows": len(rows),
        "rows_lost": len(lost),
        "rows_with_other_tokens": len(wrong),
        "completion_tokens_received": sum(received.values()),
        "completion_tokens_lost": sum(received[rid] for rid in lost),
        "rows_without_a_whole_response": len(set(rows) - set(received)),
    }


def _workdir(data_dir: Path | None) -> tuple[Path, Path]:
    root = Path(data_dir or tempfile.mkdtemp(prefix="loraplex-usage-bench-"))
    model = init_tiny(Path(tempfile.gettempdir()) / "loraplex-bench-tiny-model")
    return root, model


def sigkill_loss(
    budget_s: float = 55.0,
    clients: int = 8,
    seed: int = 0,
    data_dir: Path | None = None,
    model: Path | None = None,
    min_kills: int = 1,
) -> dict[str, Any]:
    """SIGKILL the server at random moments of a load; count received responses without a row.

    Args:
        budget_s: Kill rounds go on while another round (load + restart, timed from the last)
            fits in this many seconds from the first start (at least ``min_kills`` rounds).
        clients: Concurrent clients.
        seed: Random seed (kill moments, request mix).
        data_dir: The server's data directory (default: a new temporary one).
        model: A tiny model directory (default: written once under the temporary directory).
        min_kills: Rounds to do whatever the budget.

    Returns:
        ``usage_rows_lost_sigkill`` and the figures of :func:`compare`, ``sigkill_rounds``,
        ``seconds``.
    """
    root, default_model = _workdir(data_dir)
    rng = random.Random(seed)
    server = LiveServer(root / "data", model or default_model, args=NO_LIMITS)
    began = time.monotonic()
    server.start()
    tenant = server.create_tenant("sigkill")
    served = server.model.name
    received: dict[str, int] = {}
    kills, round_s = 0, 0.0
    try:
        while kills < min_kills or time.monotonic() - began + round_s < budget_s:
            t0 = time.monotonic()
            load = Load(server.base_url, tenant["api_key"], served, clients, seed + kills).start()
            time.sleep(rng.uniform(1.0, 3.0))
            server.kill(signal.SIGKILL)
            load.stop()
            received.update(load.received)
            kills += 1
            server.start()
            round_s = time.monotonic() - t0
        server.usage(tenant["api_key"])  # flushes the writer: replayed rows are in
        rows = stored_rows(f"sqlite+aiosqlite:///{server.data_dir / 'loraplex.db'}", tenant["id"])
    finally:
        server.stop()
    figures = compare(received, rows)
    return {
        "usage_rows_lost_sigkill": figures["rows_lost"] + figures["rows_with_other_tokens"],
        "sigkill_rounds": kills,
        **{f"sigkill_{k}": v for k, v in figures.items()},
        "sigkill_seconds": round(time.monotonic() - began, 1),
    }


def _pg_url() -> str | None:
    """The PostgreSQL database the bench may wipe, if one answers."""
    from loraplex.gateway.db.session import db_url

    raw = os.environ.get("LORAPLEX_BENCH_PG_URL") or os.environ.get("LORAPLEX_TEST_PG_URL")
    if not raw:
        return None
    url = db_url(".", raw)
    try:
        _wipe(url)
    except Exception:
        return None
    return url


def _wipe(url: str) -> None:
    from sqlalchemy import text

    from loraplex.gateway.db.session import make_engine

    async def main() -> None:
        engine = make_engine(url)
        try:
            async with engine.begin() as conn:
                await conn.execute(
                    text(
                        "DROP TABLE IF EXISTS usage_hourly, usage_hourly_latency, usage_events, "
                        "adapters, api_keys, tenants, "
                        "alembic_version CASCADE"
                    )
                )
        finally:
            await engine.dispose()

    asyncio.run(main())


def db_outage_loss(
    outage_s: float = 4.0,
    clients: int = 8,
    seed: int = 0,
    data_dir: Path | None = None,
    model: Path | None = None,
) -> dict[str, Any]:
    """PostgreSQL cut during a load, the server stopped while it is down, then both back.

    Returns:
        ``usage_rows_lost_db_outage`` with the figures of :func:`compare`, the statuses seen
        during the outage (``db_outage_served``, ``db_outage_503``, ``db_outage_500``) and
        ``db_outage_shutdown_exit`` (the server's exit status at SIGTERM); or, without a
        reachable PostgreSQL, ``usage_rows_lost_db_outage: None`` and a ``db_outage_note``.
    """
    from sqlalchemy.engine import make_url

    from bench.hostile.tcp_proxy import TcpProxy

    url = _pg_url()
    if url is None:
        note = "no PostgreSQL reachable (set LORAPLEX_BENCH_PG_URL or LORAPLEX_TEST_PG_URL)"
        return {"usage_rows_lost_db_outage": None, "db_outage_note": note}
    root, default_model = _workdir(data_dir)
    began = time.monotonic()
    target = make_url(url)
    with TcpProxy(target.host, target.port) as proxy:
        args = [*NO_LIMITS, "--db-url", proxy.url_for(url)]
        server = LiveServer(root / "data", model or default_model, args=args)
        server.start()
        try:
            tenant = server.create_tenant("outage")
            load = Load(server.base_url, tenant["api_key"], server.model.name, clients, seed)
            load.start()
            time.sleep(1.5)
            before = Counter(load.statuses)
            proxy.cut()
            time.sleep(outage_s)
            during = Counter(load.statuses)
            during.subtract(before)
            exit_status = server.kill(signal.SIGTERM)  # shutdown with the database still down
            load.stop()
            proxy.restore()
            server.start()
            server.usage(tenant["api_key"])  # flushes: the spooled rows are written
            rows = stored_rows(url, tenant["id"])
            log = server.log()
        finally:
            server.stop()
    figures = compare(load.received, rows)
    return {
        "usage_rows_lost_db_outage": figures["rows_lost"] + figures["rows_with_other_tokens"],
        **{f"db_outage_{k}": v for k, v in figures.items()},
        "db_outage_served": during[200],
        "db_outage_503": during[503],
        "db_outage_500": sum(n for s, n in load.statuses.items() if s == 500),
        "db_outage_shutdown_exit": exit_status,
        "db_outage_tracebacks": log.count("Traceback"),
        "db_outage_seconds": round(time.monotonic() - began, 1),
    }


def main() -> None:
    """Run both parts; print a table and one JSON line."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one SIGKILL round only")
    args = parser.parse_args()
    budget = 0.0 if args.quick else 55.0
    figures = {**sigkill_loss(budget_s=budget), **db_outage_loss()}
    width = max(len(k) for k in figures)
    for name, value in figures.items():
        print(f"{name:<{width}}  {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
