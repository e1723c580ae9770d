from concurrent.futures import ThreadPoolExecutor

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from gateway.db.migrate import current_revision, head_revision, upgrade, upgrade_async
from gateway.db.models import Base
from tests.gateway.conftest import run, with_db

TABLES = {"tenants", "api_keys", "adapters", "usage_events"}


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
