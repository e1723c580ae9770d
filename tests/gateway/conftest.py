"""Gateway database fixtures: a fresh SQLite file per test, migrated by Alembic.

``test_pg.py`` overrides ``fresh_url`` to run the same tests on PostgreSQL.
"""

import asyncio
import time
from pathlib import Path

import pytest

from loraplex.gateway.db.migrate import upgrade
from loraplex.gateway.db.session import make_engine, session_factory

SECRET = b"s" * 32
PG_TABLES = (
    "usage_hourly, usage_hourly_latency, batches, files, stored_responses, usage_events, adapters, "
    "api_keys, tenants, alembic_version"
)


def run(coro):
    return asyncio.run(coro)


def with_db(url, body):
    """Run ``await body(sessions)`` on a fresh engine; ``sessions`` is an async_sessionmaker."""

    async def main():
        engine = make_engine(url)
        try:
            return await body(session_factory(engine))
        finally:
            await engine.dispose()

    return run(main())


def wipe_pg(url):
    """Drop every loraplex table of the PostgreSQL database at ``url``."""
    from sqlalchemy import text

    async def main():
        engine = make_engine(url)
        try:
            async with engine.begin() as conn:
                await conn.execute(text(f"DROP TABLE IF EXISTS {PG_TABLES} CASCADE"))
        finally:
            await engine.dispose()

    run(main())


@pytest.fixture
def fresh_url(tmp_path):
    """An empty database."""
    return f"sqlite+aiosqlite:///{tmp_path / 'test.db'}"


@pytest.fixture
def database_url(fresh_url):
    """A database migrated to head."""
    upgrade(fresh_url)
    return fresh_url


def adapter_store_dir(llava_dir):
    """The adapter store shared by the session engine and every live gateway."""
    return llava_dir.parent / "gateway-adapter-store"


@pytest.fixture(scope="session")
def engine_client(llava_dir):
    """One engine (the tiny LLaVA, float32, CPU) shared by every live-gateway test."""
    from loraplex.engine.config import EngineConfig
    from loraplex.gateway.server.build import start_engine

    client = start_engine(
        EngineConfig(
            model=str(llava_dir),
            served_model_name="tiny-llava",
            num_kv_blocks=512,
            max_loras=4,
        ),
        adapter_store_dir(llava_dir),
    )
    yield client
    client.shutdown()


@pytest.fixture
def live(engine_client, tmp_path):
    """A gateway on loopback with a fresh SQLite database, sharing the session's engine.

    After the test: every KV block is back (nothing leaked by any request of the test).
    """
    from tests.gateway.live import LiveGateway

    store = adapter_store_dir(Path(engine_client.config.model))
    with LiveGateway(engine_client, tmp_path / "data", adapter_store_dir=store) as gw:
        yield gw
    deadline = time.monotonic() + 10
    while engine_client.stats()["kv_blocks_in_use"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_client.stats()["kv_blocks_in_use"] == 0, "KV blocks leaked"


@pytest.fixture
def client(live):
    """An ``openai`` SDK client of a new tenant ``acme`` on the live gateway."""
    return live.openai(live.create_tenant("acme")["api_key"])


@pytest.fixture(scope="session")
def tiny_adapter(hf_llava, tmp_path_factory):
    """A PEFT adapter for the tiny LLaVA, saved once (``chat_support.make_tiny_adapter``)."""
    from tests.gateway.chat_support import make_tiny_adapter

    return make_tiny_adapter(hf_llava, tmp_path_factory.mktemp("peft"))
