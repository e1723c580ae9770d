from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from loraplex.gateway.db.migrate import current_revision, head_revision, upgrade, upgrade_async
from loraplex.gateway.db.models import Base
from tests.gateway.conftest import run, with_db

TABLES = {"tenants", "api_keys", "adapters", "usage_events", "stored_responses", "files", "batches"}


def schema_diff(url, metadata):
    async def body(sessions):
        async with sessions() as session:
            conn = await session.connection()
            return await conn.run_sync(
                lambda sync: compare_metadata(
                    MigrationContext.configure(
                        sync, opts={"compare_type": True, "compare_server_default": True}
                    ),
                    metadata,
                )
            )

    return with_db(url, body)


def table_names(url):
    async def body(sessions):
        async with sessions() as session:
            conn = await session.connection()
            return await conn.run_sync(lambda sync: set(sa.inspect(sync).get_table_names()))

    return with_db(url, body)


def test_upgrade_from_scratch_creates_every_table(fresh_url):
    assert run(current_revision(fresh_url)) is None
    upgrade(fresh_url)
    assert run(current_revision(fresh_url)) == head_revision()
    assert TABLES | {"alembic_version"} <= table_names(fresh_url)


def test_upgrade_is_idempotent(fresh_url):
    upgrade(fresh_url)
    upgrade(fresh_url)
    assert run(current_revision(fresh_url)) == head_revision()
    assert schema_diff(fresh_url, Base.metadata) == []


def test_migrated_schema_matches_the_models(database_url):
    assert schema_diff(database_url, Base.metadata) == []


def test_schema_comparison_is_not_vacuous(database_url):
    # The same models plus one column: the comparison must notice.
    metadata = sa.MetaData(naming_convention=Base.metadata.naming_convention)
    for table in Base.metadata.sorted_tables:
        table.to_metadata(metadata)
    metadata.tables["tenants"].append_column(sa.Column("extra", sa.Integer()))
    diff = schema_diff(database_url, metadata)
    assert [d[0] for d in diff] == ["add_column"]


def test_upgrade_async_inside_a_running_loop(fresh_url):
    # serve awaits it on start-up: no nested asyncio.run in env.py
    run(upgrade_async(fresh_url))
    assert run(current_revision(fresh_url)) == head_revision()


def test_concurrent_upgrades_agree(fresh_url):
    # serve and a CLI command starting together on a fresh database
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(upgrade, [fresh_url] * 4))
    assert run(current_revision(fresh_url)) == head_revision()
    assert schema_diff(fresh_url, Base.metadata) == []


WHEN = datetime(2025, 1, 1, tzinfo=UTC)


def test_0002_copies_the_client_id_out_of_old_usage_keys(fresh_url):
    """Rows keyed ``<tenant>:<X-Request-Id>`` before 0002 get that id in client_request_id."""
    upgrade(fresh_url, "0001")
    tenant = "a" * 32
    old_keys = {
        f"{tenant}:retry-1": "retry-1",  # the old client-id key
        "chatcmpl-0123": None,  # a response id
        f"{tenant}:" + "y" * 65: None,  # longer than a client id may be
        f"{'b' * 32}:zzz": None,  # not this row's tenant
    }

    async def fill(sessions):
        async with sessions.begin() as s:
            await s.execute(
                sa.text("INSERT INTO tenants (id, name, created_at) VALUES (:i, 'acme', :t)"),
                {"i": tenant, "t": WHEN},
            )
            for key in old_keys:
                await s.execute(
                    sa.text(
                        "INSERT INTO usage_events (request_id, tenant_id, model, status, "
                        "created_at) VALUES (:r, :t, 'm', 'ok', :c)"
                    ),
                    {"r": key, "t": tenant, "c": WHEN},
                )

    async def read(sessions):
        async with sessions() as s:
            query = "SELECT request_id, client_request_id FROM usage_events"
            return dict((await s.execute(sa.text(query))).all())

    with_db(fresh_url, fill)
    upgrade(fresh_url)
    assert with_db(fresh_url, read) == old_keys
    assert schema_diff(fresh_url, Base.metadata) == []
