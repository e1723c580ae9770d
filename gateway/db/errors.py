"""What a database failure means: the database is unreachable, or it refused what it was given.

The two call for opposite answers. An unreachable database (refused or dropped connection, a
timeout, a server shutting down or out of connections, SQLite's "database is locked") is
transient: a request gets 503 + ``Retry-After`` and the usage writer keeps its rows and tries
again later. A refusal (a value the column cannot hold, a constraint) is about the statement: it
fails the same way every time, so retrying it forever would block everything queued behind it.

PostgreSQL's errors carry a SQLSTATE whose class says which (PostgreSQL manual, appendix A
"PostgreSQL Error Codes"): 08 connection exception, 40 transaction rollback (serialization
failure, deadlock), 53 insufficient resources, 57 operator intervention (shutdown, cannot
connect now), 58 system error and XX internal error are transient; 22 data exception, 23
integrity constraint violation, 42 syntax or access rule violation and the rest are refusals.
Without a SQLSTATE (SQLite, driver-side errors) the DB-API class decides: ``OperationalError``
and ``InterfaceError`` are transient, the others refusals.
"""

from __future__ import annotations

from sqlalchemy import exc as sa_exc

# SQLSTATE classes (first two characters) of transient failures.
TRANSIENT_SQLSTATE_CLASSES = frozenset({"08", "40", "53", "57", "58", "XX"})
DATA_EXCEPTION_CLASS = "22"


class DatabaseUnavailable(ConnectionError):
    """The database could not be reached (raised by the connect hook in ``gateway.db.session``).

    The driver's own connect errors (``ConnectionRefusedError``, ``socket.gaierror``, a
    timeout) are not DB-API errors, so SQLAlchemy passes them through unwrapped; this names
    them, so that a request handler can tell a database outage from any other ``OSError``.
    """


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a (wrapped) driver error, if it has one."""
    orig = getattr(exc, "orig", exc)
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return code if isinstance(code, str) and len(code) == 5 else None


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` means the database is (for now) out of reach, not that it refused.

    Args:
        exc: An exception raised while talking to the database.

    Returns:
        True for connection failures, timeouts, pool exhaustion and the transient SQLSTATE
        classes; False for refusals and for anything that is not a database error.
    """
    if isinstance(exc, (OSError, sa_exc.TimeoutError, sa_exc.DisconnectionError)):
        return True  # OSError covers DatabaseUnavailable, ConnectionError and TimeoutError
    if not isinstance(exc, sa_exc.DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    code = sqlstate(exc)
    if code is not None:
        return code[:2] in TRANSIENT_SQLSTATE_CLASSES
    if isinstance(exc.orig, OSError):
        return True
    return isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError))


def is_data_error(exc: BaseException) -> bool:
    """Whether the database refused a value (SQLSTATE class 22: NUL byte, out of range...)."""
    code = sqlstate(exc) if isinstance(exc, sa_exc.DBAPIError) else None
    return code is not None and code[:2] == DATA_EXCEPTION_CLASS


def describe(exc: BaseException, limit: int = 160) -> str:
    """A one-line description of ``exc`` for a log line: its class and first line, no SQL."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()[0] if str(orig).strip() else ""
    code = sqlstate(exc)
    name = type(orig).__name__ + (f" {code}" if code else "")
    line = f"{name}: {text}" if text else name
    return line if len(line) <= limit else line[: limit - 3] + "..."
