"""Database URLs, async engines and session factories.

SQLite (the default, ``DATA_DIR/loraplex.db``) runs through ``aiosqlite``; PostgreSQL through
``asyncpg`` (``postgresql+asyncpg://user:pass@host/db``). A plain ``sqlite:///``,
``postgresql://`` or ``postgres://`` URL is given the async driver. An SQLite database file is
created 0600 before SQLite opens it (SQLite gives its ``-wal`` and ``-shm`` files the database
file's mode), and an existing one readable by others is tightened with them.

A connection that cannot be opened raises :class:`gateway.db.errors.DatabaseUnavailable`
(the driver's own ``OSError`` otherwise passes through SQLAlchemy unwrapped), within
``PG_CONNECT_TIMEOUT_S`` on PostgreSQL, so a request path can answer 503 at once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from loraplex.gateway.db.errors import DatabaseUnavailable

DB_FILENAME = "loraplex.db"
ENV_DB_URL = "LORAPLEX_DB_URL"
SQLITE_BUSY_TIMEOUT_MS = 10_000
PG_CONNECT_TIMEOUT_S = 5.0  # asyncpg's default is 60 s: every request would hang that long

_ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
}


def db_url(data_dir: str | Path, explicit: str | None = None) -> str:
    """The database URL: ``--db-url``, else ``$LORAPLEX_DB_URL``, else SQLite in the data dir.

    Args:
        data_dir: The data directory; the default database is ``data_dir/loraplex.db``.
        explicit: The ``--db-url`` flag, if given.

    Returns:
        An async SQLAlchemy URL (``sqlite+aiosqlite:///...`` or ``postgresql+asyncpg://...``).
    """
    url = explicit or os.environ.get(ENV_DB_URL)
    if not url:
        return f"sqlite+aiosqlite:///{Path(data_dir).resolve() / DB_FILENAME}"
    scheme, sep, rest = url.partition("://")
    return f"{_ASYNC_DRIVERS.get(scheme, scheme)}{sep}{rest}"


def is_sqlite(url: str) -> bool:
    """Whether ``url`` names an SQLite database."""
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(url: str, *, for_migrations: bool = False, **kwargs: Any) -> AsyncEngine:
    """An async engine for ``url``.

    On SQLite every connection gets ``journal_mode=WAL`` (readers never block the writer)
    with ``synchronous=NORMAL``,
    a busy timeout, and ``foreign_keys=ON``. An engine ``for_migrations`` instead leaves
    foreign keys off (batch mode rebuilds tables by copy, drop and rename, which enforced
    foreign keys would break) and makes transactions real: ``BEGIN IMMEDIATE`` takes the
    write lock up front, so DDL is atomic and concurrent upgrades queue instead of racing.

    Args:
        url: An async SQLAlchemy URL (see ``db_url``).
        for_migrations: Configure the engine for running Alembic migrations.
        **kwargs: Passed to ``create_async_engine``.
    """
    if make_url(url).get_backend_name() == "postgresql":
        kwargs["connect_args"] = {"timeout": PG_CONNECT_TIMEOUT_S, **kwargs.get("connect_args", {})}
    engine = create_async_engine(url, **kwargs)
    event.listen(engine.sync_engine, "do_connect", _connect)
    if engine.dialect.name != "sqlite":
        return engine
    database = make_url(url).database
    if database not in (None, "", ":memory:") and not database.startswith("file:"):
        private_sqlite_file(database)

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        if for_migrations:
            dbapi_connection.isolation_level = None  # let the "begin" hook below emit BEGIN
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute(f"PRAGMA foreign_keys = {'OFF' if for_migrations else 'ON'}")
        if make_url(url).database not in (None, "", ":memory:"):
            _enable_wal(cursor)
            # WAL + NORMAL: a commit is durable across process crashes (not power loss) and
            # costs no fsync per transaction; the usage writer commits often.
            cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.close()

    if for_migrations:

        @event.listens_for(engine.sync_engine, "begin")
        def _on_begin(connection: Any) -> None:
            connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def private_sqlite_file(path: str | Path) -> None:
    """Make the database file 0600 before SQLite creates it; tighten its journal files.

    Raises:
        OSError: the file cannot be made (its directory is missing or not writable).
    """
    from loraplex.gateway.settings import private_file

    path = Path(path)
    private_file(path)
    for suffix in ("-wal", "-shm", "-journal"):
        journal = path.with_name(path.name + suffix)
        if journal.exists():
            private_file(journal)


def _connect(dialect: Any, _record: Any, cargs: list, cparams: dict) -> Any:
    """Open the DB-API connection; a driver's ``OSError`` becomes ``DatabaseUnavailable``.

    Raises:
        DatabaseUnavailable: the server cannot be reached (refused, unknown host, timeout).
    """
    try:
        return dialect.connect(*cargs, **cparams)
    except OSError as exc:  # ConnectionRefusedError, socket.gaierror, TimeoutError
        raise DatabaseUnavailable(f"cannot connect to the database: {exc}") from exc


def _enable_wal(cursor: Any) -> None:
    """Put the database in WAL mode (persistent: a no-op once any connection did it).

    Switching needs the database to itself, and SQLite can answer "database is locked" at once,
    without the busy timeout, while another connection holds a transaction (several processes
    migrating a fresh database together: ``serve`` and a CLI command). Retried until the busy
    timeout; a database already in WAL mode is only read.

    Raises:
        sqlite3.OperationalError: still locked after ``SQLITE_BUSY_TIMEOUT_MS``, or another
            failure.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode")
            if str(cursor.fetchone()[0]).lower() != "wal":
                cursor.execute("PRAGMA journal_mode = WAL")
            return
        except Exception as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def session_factory(engine: AsyncEngine) -> async_sessionmaker:
    """Sessions bound to ``engine``; objects stay readable after commit."""
    return async_sessionmaker(engine, expire_on_commit=False)
