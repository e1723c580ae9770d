"""The migration, service and usage-writer tests again, on PostgreSQL.

Set ``LORAPLEX_TEST_PG_URL`` (e.g. ``postgresql+asyncpg://loraplex:loraplex@127.0.0.1:5433/
loraplex_test``) to a database these tests may wipe; skipped otherwise.
"""

import os

import pytest

from loraplex.gateway.db.session import db_url
from tests.gateway.conftest import wipe_pg
from tests.gateway.test_batch_lease import *  # noqa: F403
from tests.gateway.test_migrations import *  # noqa: F403
from tests.gateway.test_services import *  # noqa: F403
from tests.gateway.test_usage_writer import *  # noqa: F403

PG_URL = os.environ.get("LORAPLEX_TEST_PG_URL")

pytestmark = [
    pytest.mark.service,
    pytest.mark.skipif(not PG_URL, reason="LORAPLEX_TEST_PG_URL is not set"),
]


@pytest.fixture
def fresh_url():
    """The PostgreSQL test database, emptied."""
    url = db_url(".", PG_URL)
    wipe_pg(url)
    return url
