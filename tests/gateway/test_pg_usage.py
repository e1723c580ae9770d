"""Usage on PostgreSQL when the database misbehaves: an outage, a NUL character.

The outage is a :class:`bench.hostile.tcp_proxy.TcpProxy` between the gateway and the test
database, cut and restored (the database itself, shared with other tests, keeps running). Set
``LORAPLEX_TEST_PG_URL`` to a database these tests may wipe; skipped otherwise.
"""

import json
import logging
import os
import time
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url

from bench.hostile.tcp_proxy import TcpProxy
from loraplex.gateway.db.models import UsageEvent
from loraplex.gateway.db.session import db_url
from tests.gateway.conftest import adapter_store_dir, wipe_pg, with_db
from tests.gateway.live import LiveGateway
from tests.gateway.test_app_basics import assert_openai_error

PG_URL = os.environ.get("LORAPLEX_TEST_PG_URL")

pytestmark = [
    pytest.mark.service,
    pytest.mark.skipif(not PG_URL, reason="LORAPLEX_TEST_PG_URL is not set"),
]

MODEL = "tiny-llava"
HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def pg_url():
    url = db_url(".", PG_URL)
    wipe_pg(url)
    return url


def chat(gw, key, stream=False, **extra):
    """POST a chat; returns (status, response id or None, completion tokens or None, body)."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 3, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with gw.client(key) as c:
        r = c.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        return r.status_code, None, None, r
    if not stream:
        data = r.json()
        return 200, data["id"], data["usage"]["completion_tokens"], r
    events = [e[len("data: ") :] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", r.text
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), r.text
    return 200, chunks[0]["id"], chunks[-1]["usage"]["completion_tokens"], r


def rows_of(url, tenant_id):
    async def body(sessions):
        async with sessions() as s:
            found = await s.scalars(select(UsageEvent).where(UsageEvent.tenant_id == tenant_id))
            return {row.request_id: row for row in found}

    return with_db(url, body)


class Lines(logging.Handler):
    """The records of the ``gateway`` loggers (some library replaces the root's handlers)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        self.logger = logging.getLogger("loraplex.gateway")
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def test_a_database_outage_serves_spools_answers_503_and_replays(engine_client, pg_url, tmp_path):
    store = adapter_store_dir(Path(engine_client.config.model))
    target = make_url(pg_url)
    data = tmp_path / "data"
    received = {}  # response id -> completion tokens, for every answer a client got whole
    with TcpProxy(target.host, target.port) as proxy:
        url = proxy.url_for(pg_url)
        config = {"adapter_store_dir": store, "auth_cache_seconds": 0.2}
        with LiveGateway(engine_client, data, db=url, **config) as gw:
            a = gw.create_tenant("outage-a")
            b = gw.create_tenant("outage-b")  # its key is never verified before the outage
            status, rid, tokens, _ = chat(gw, a["api_key"])
            received[rid] = tokens

            log = Lines().__enter__()
            proxy.cut()
            time.sleep(0.5)  # past the key cache's 0.2 s freshness and 0.2 s stale window
            for i in range(6):  # served: a's key was verified, rows go to the spool
                status, rid, tokens, r = chat(gw, a["api_key"], stream=i % 2 == 1)
                assert status == 200, r.text
                received[rid] = tokens
            with gw.client(b["api_key"]) as c:
                r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI})
            unverified = r
            with gw.client(a["api_key"]) as c:
                usage = c.get("/v1/usage")
            adapter = chat(gw, a["api_key"], model="my-adapter")[3]  # a database lookup
            with gw.admin() as c:
                admin = c.post("/admin/tenants", json={"name": "during-outage"})
            for r in (unverified, usage, adapter, admin):
                assert_openai_error(r, 503)
                assert r.headers["retry-after"] == "2"
            log.__exit__()
            assert not [r for r in log.records if r.exc_info], "a traceback was logged"
            lines = [r.getMessage() for r in log.records]
            assert sum("usage database unreachable" in line for line in lines) == 1, lines
            assert sum("database unavailable on" in line for line in lines) <= 2, lines

            proxy.restore()  # back: the running writer writes the backlog
            deadline = time.monotonic() + 15
            while gw.state.usage.outage_since is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            with gw.client(a["api_key"]) as c:
                totals = c.get("/v1/usage").json()["totals"]
            assert totals["requests"] == len(received) + 1  # + the adapter lookup's error row
            assert totals["completion_tokens"] == sum(received.values())

            proxy.cut()  # down again, then the server stops: the rows wait in the spool
            for i in range(3):
                status, rid, tokens, r = chat(gw, a["api_key"], stream=i == 1)
                assert status == 200, r.text
                received[rid] = tokens
        assert list((data / "usage-spool").glob("*.spool")), "the rows should be spooled"

        proxy.restore()
        with LiveGateway(engine_client, data, db=url, **config) as gw:
            assert gw.state.usage.replayed == 3
            with gw.client(a["api_key"]) as c:
                totals = c.get("/v1/usage").json()["totals"]
    rows = rows_of(pg_url, a["id"])
    assert set(received) <= set(rows)
    assert totals["requests"] == len(received) + 1 == len(rows)
    assert totals["completion_tokens"] == sum(received.values())
    assert list((data / "usage-spool").glob("*.spool")) == []


def test_a_nul_in_model_is_a_4xx_and_later_rows_are_written(engine_client, pg_url, tmp_path):
    """Issue 13: a NUL in ``model`` got a 500 on PostgreSQL and its row blocked every row after
    it (50/50 lost, GET /v1/usage hung)."""
    store = adapter_store_dir(Path(engine_client.config.model))
    with LiveGateway(engine_client, tmp_path / "data", db=pg_url, adapter_store_dir=store) as gw:
        tenant = gw.create_tenant("nul")
        key = tenant["api_key"]
        for model in ("bad\x00model", "\x00", "x" * 300 + "\x00"):
            status, _, _, r = chat(gw, key, model=model)
            assert status == 404, r.text
            assert r.json()["error"]["code"] == "model_not_found"
        received = {}
        for i in range(5):
            status, rid, tokens, r = chat(gw, key, stream=i % 2 == 0)
            assert status == 200, r.text
            received[rid] = tokens
        with gw.client(key) as c:
            r = c.get("/v1/usage", timeout=10)
            assert r.status_code == 200, r.text
            totals = r.json()["totals"]
            assert c.get("/v1/adapters/a%00b").status_code in (400, 404)
        assert totals["requests"] == 8
        assert totals["completion_tokens"] == sum(received.values())
        assert gw.state.usage.dead_lettered == 0
    rows = rows_of(pg_url, tenant["id"])
    assert set(received) <= set(rows)
    assert sorted(r.model for r in rows.values() if r.status == "error")[0].startswith("bad\ufffd")
