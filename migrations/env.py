"""Alembic environment: async engines, batch mode (so SQLite can alter tables).

Normally run through ``gateway.db.migrate``, which hands over an open connection in
``config.attributes["connection"]``; without one (Alembic's own command line), it opens an async
engine on ``sqlalchemy.url``.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from loraplex.gateway.db.models import Base
from loraplex.gateway.db.session import make_engine

config = context.config
target_metadata = Base.metadata


def _configure(**kwargs) -> None:
    context.configure(
        target_metadata=target_metadata, render_as_batch=True, compare_type=True, **kwargs
    )


def run_migrations_offline() -> None:
    """Emit the SQL for ``sqlalchemy.url``'s dialect without connecting."""
    _configure(
        url=config.get_main_option("sqlalchemy.url"),
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_with(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = make_engine(config.get_main_option("sqlalchemy.url"), for_migrations=True)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(_run_with)
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    """Run on the connection handed over, or on a fresh async engine."""
    connection = config.attributes.get("connection")
    if connection is None:
        asyncio.run(_run_async())
    else:
        _run_with(connection)


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
