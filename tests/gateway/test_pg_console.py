"""The console's usage queries and the rollup trigger (migration 0006) on PostgreSQL.

Set ``LORAPLEX_TEST_PG_URL`` to a database these tests may wipe; skipped otherwise.
"""

import os

import pytest

from loraplex.gateway.db.migrate import upgrade
from loraplex.gateway.db.session import db_url
from tests.gateway.conftest import wipe_pg
from tests.gateway.test_console import check_usage_queries

PG_URL = os.environ.get("LORAPLEX_TEST_PG_URL")
pytestmark = [
    pytest.mark.service,
    pytest.mark.skipif(not PG_URL, reason="LORAPLEX_TEST_PG_URL is not set"),
]


def test_usage_queries_on_postgresql():
    url = db_url(".", PG_URL)
    wipe_pg(url)
    upgrade(url)
    try:
        check_usage_queries(url)
    finally:
        wipe_pg(url)
