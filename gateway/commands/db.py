"""``loraplex db upgrade [--db-url URL] [--data-dir DIR]``, and the shared database set-up.

The ``tenants`` and ``keys`` commands use ``add_db_args``, ``resolve`` and ``migrated_session``
from here, so each of them works on a fresh data directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.gateway.db.migrate import current_revision, upgrade_async
from loraplex.gateway.db.session import db_url, is_sqlite, make_engine, session_factory
from loraplex.gateway.services.errors import ServiceError
from loraplex.gateway.settings import data_dir


def add_db_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--data-dir`` and ``--db-url`` to a subcommand."""
    parser.add_argument(
        "--data-dir", default=None, help="data directory (default $LORAPLEX_DATA_DIR or .loraplex)"
    )
    parser.add_argument(
        "--db-url",
        default=None,
        help="SQLAlchemy URL, e.g. postgresql+asyncpg://user:pass@host/db "
        "(default $LORAPLEX_DB_URL, else SQLite in the data directory)",
    )


def resolve(args: argparse.Namespace) -> tuple[Path, str]:
    """The data directory (created if missing) and the database URL for ``args``."""
    directory = data_dir(args.data_dir)
    directory.mkdir(parents=True, exist_ok=True)
    return directory, db_url(directory, args.db_url)


@asynccontextmanager
async def migrated_session(url: str) -> AsyncIterator[AsyncSession]:
    """Bring the database up to date, then yield a session inside a transaction.

    The transaction commits when the block exits normally and rolls back on an exception.
    """
    await upgrade_async(url)
    engine = make_engine(url)
    try:
        async with session_factory(engine)() as session, session.begin():
            yield session
    finally:
        await engine.dispose()


# What a command reports as one line and exit status 1: refusals, bad files, an unreachable or
# broken database.
CLI_ERRORS = (ServiceError, ValueError, OSError, SQLAlchemyError)


def fail(command: str, exc: Exception) -> int:
    """Print one clear error line (never a traceback) and return exit status 1."""
    print(f"loraplex {command}: error: {exc}", file=sys.stderr)
    return 1


def register(subparsers) -> None:
    """Add the ``db`` command group."""
    db = subparsers.add_parser("db", help="database maintenance")
    sub = db.add_subparsers(dest="db_command", metavar="SUBCOMMAND", required=True)
    up = sub.add_parser("upgrade", help="apply the schema migrations (idempotent)")
    add_db_args(up)
    up.set_defaults(func=_upgrade)


def _upgrade(args: argparse.Namespace) -> int:
    _, url = resolve(args)

    async def run() -> str | None:
        await upgrade_async(url)
        return await current_revision(url)

    try:
        revision = asyncio.run(run())
    except CLI_ERRORS as exc:
        return fail("db upgrade", exc)
    backend = "sqlite" if is_sqlite(url) else "postgresql"
    print(json.dumps({"revision": revision, "backend": backend}))
    return 0
