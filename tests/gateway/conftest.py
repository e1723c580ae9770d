"""Gateway database fixtures: a fresh SQLite file per test, migrated by Alembic.

``test_pg.py`` overrides ``fresh_url`` to run the same tests on PostgreSQL.
"""

import asyncio

import pytest

from gateway.db.migrate import upgrade
from gateway.db.session import make_engine, session_factory

SECRET = b"s" * 32


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


@pytest.fixture
def fresh_url(tmp_path):
    """An empty database."""
    return f"sqlite+aiosqlite:///{tmp_path / 'test.db'}"


@pytest.fixture
def database_url(fresh_url):
    """A database migrated to head."""
    upgrade(fresh_url)
    return fresh_url
