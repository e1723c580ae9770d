"""A database failure on a request path: 503 + ``Retry-After`` (unreachable) or 400 (a refused
value), OpenAI's error body, one short log line, never a 500 with a traceback (issue 13: a
PostgreSQL outage answered 500 with a 120-line traceback per request).

The database is made unreachable for the routes by swapping the gateway's session factory for
one whose sessions fail as a dead server's do (the usage writer keeps its own, working one);
``test_pg_usage.py`` cuts a real PostgreSQL connection instead.
"""

import logging

import pytest
from sqlalchemy import exc as sa_exc

from loraplex.gateway.db.errors import DatabaseUnavailable, describe, is_data_error, is_unreachable
from tests.gateway.live import instant_gateway
from tests.gateway.test_app_basics import assert_openai_error

HI = [{"role": "user", "content": "hi"}]


class Orig(Exception):
    """A driver error with a SQLSTATE, as asyncpg's (through SQLAlchemy's adapter) has."""

    def __init__(self, message, sqlstate):
        super().__init__(message)
        self.sqlstate = sqlstate


def dbapi_error(cls, message, sqlstate=None):
    return cls("SELECT 1", {}, Orig(message, sqlstate))


@pytest.mark.parametrize(
    ("error", "unreachable", "data"),
    [
        (DatabaseUnavailable("connection refused"), True, False),
        (ConnectionResetError(), True, False),
        (TimeoutError(), True, False),
        (sa_exc.TimeoutError("QueuePool limit reached"), True, False),
        (dbapi_error(sa_exc.OperationalError, "database is locked"), True, False),
        (dbapi_error(sa_exc.DBAPIError, "terminating connection", "57P01"), True, False),
        (dbapi_error(sa_exc.DBAPIError, "too many connections", "53300"), True, False),
        (dbapi_error(sa_exc.DBAPIError, "connection failure", "08006"), True, False),
        (dbapi_error(sa_exc.DBAPIError, "invalid byte sequence: 0x00", "22021"), False, True),
        (dbapi_error(sa_exc.IntegrityError, "foreign key violation", "23503"), False, False),
        (dbapi_error(sa_exc.IntegrityError, "FOREIGN KEY constraint failed"), False, False),
        (ValueError("a bug"), False, False),
    ],
)
def test_unreachable_and_refused_are_told_apart(error, unreachable, data):
    assert is_unreachable(error) is unreachable
    assert is_data_error(error) is data
    assert "\n" not in describe(error) and len(describe(error)) <= 160


class DeadSessions:
    """A session factory whose sessions fail on entry with ``error``."""

    def __init__(self, error):
        self.error = error

    def __call__(self):
        error = self.error

        class Dead:
            async def __aenter__(self):
                raise error

            async def __aexit__(self, *exc):
                return False

            def begin(self):
                return self

        return Dead()

    def begin(self):
        return self()


@pytest.mark.parametrize(
    "error",
    [
        DatabaseUnavailable("cannot connect to the database: [Errno 111] Connect call failed"),
        dbapi_error(sa_exc.OperationalError, "database is locked"),
    ],
)
def test_every_route_answers_503_while_the_database_is_unreachable(tmp_path, error, monkeypatch):
    from loraplex.gateway import errors

    monkeypatch.setattr(errors, "_database_log", errors._ThrottledLog())  # a fresh second
    lines = []
    handler = logging.Handler()
    handler.emit = lines.append
    gateway_log = logging.getLogger("loraplex.gateway")
    gateway_log.addHandler(handler)
    try:
        with instant_gateway(tmp_path / "data") as gw:
            known = gw.create_tenant("known")
            unseen = gw.create_tenant("unseen")
            with gw.client(known["api_key"]) as c:  # verified now: cached for 2 s
                ok = c.post("/v1/chat/completions", json={"model": "instant", "messages": HI})
                assert ok.status_code == 200, ok.text
            gw.state.sessions = DeadSessions(error)
            answers = []
            with gw.client(known["api_key"]) as c:
                served = c.post("/v1/chat/completions", json={"model": "instant", "messages": HI})
                answers.append(c.post("/v1/chat/completions", json={"model": "a", "messages": HI}))
                answers.append(c.get("/v1/usage"))
                answers.append(c.get("/v1/adapters"))
            with gw.client(unseen["api_key"]) as c:  # its key must be read
                answers.append(c.post("/v1/chat/completions", json={"model": "x", "messages": HI}))
            with gw.admin() as c:
                answers.append(c.post("/admin/tenants", json={"name": "later"}))
                answers.append(c.get(f"/admin/tenants/{known['id']}"))
            assert served.status_code == 200, served.text  # the base model needs no lookup
            for r in answers:
                assert_openai_error(r, 503)
                assert r.json()["error"]["code"] == "database_unavailable"
                assert r.headers["retry-after"] == "2"
    finally:
        gateway_log.removeHandler(handler)
    assert not [r for r in lines if r.exc_info], "a traceback was logged"
    unavailable = [r for r in lines if "database unavailable" in r.getMessage()]
    assert 1 <= len(unavailable) <= 2, [r.getMessage() for r in lines]  # throttled: 1 a second
