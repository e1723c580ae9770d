"""Apply the Alembic migrations in ``migrations/`` programmatically (no ``alembic.ini``).

``loraplex db upgrade`` and every command that touches the database call ``upgrade``;
``serve`` awaits ``upgrade_async`` on start-up. Both are idempotent: at head, nothing happens.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex import migrations
from loraplex.gateway.db.session import make_engine

if TYPE_CHECKING:  # alembic is imported where it runs: the CLI starts without it
    from alembic.config import Config
    from sqlalchemy.engine import Connection

# Serialises concurrent upgrades on PostgreSQL (SQLite does it with BEGIN IMMEDIATE).
_PG_LOCK_ID = 0x6C70785F6D6967  # "lpx_mig"


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config pointing at the installed ``migrations`` package.

    Args:
        url: The database URL, for Alembic's offline mode and its own command line use.
    """
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    if url:
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def head_revision() -> str:
    """The newest revision shipped in ``migrations/versions``."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations/versions has no revision"
    return head


def _upgrade_sync(connection: Connection, revision: str) -> None:
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK_ID})")
    from alembic import command

    config = alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


async def upgrade_async(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` to ``revision``, in one transaction.

    Args:
        url: An async SQLAlchemy URL.
        revision: The target revision.
    """
    engine = make_engine(url, for_migrations=True)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(_upgrade_sync, revision)
    finally:
        await engine.dispose()


def upgrade(url: str, revision: str = "head") -> None:
    """``upgrade_async`` for synchronous callers (not from inside a running event loop)."""
    asyncio.run(upgrade_async(url, revision))


async def current_revision(url: str) -> str | None:
    """The revision the database at ``url`` is at; None when it was never migrated."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(
                lambda sync: MigrationContext.configure(sync).get_current_revision()
            )
    finally:
        await engine.dispose()
