"""Batch owner leases on a real database: one runner at a time, expired leases taken over.

``test_pg.py`` runs these again on PostgreSQL (its ``fresh_url``).
"""

import asyncio
from datetime import timedelta

from sqlalchemy import update

from loraplex.gateway.db.models import Batch, Tenant
from loraplex.gateway.db.types import utcnow
from loraplex.gateway.domains.batches.lease import (
    claim,
    claimable,
    new_owner_id,
    release,
    renew,
)
from tests.gateway.conftest import with_db


async def _batch(sessions, status="in_progress"):
    async with sessions() as session:
        tenant = Tenant(name=f"t-{new_owner_id()[-8:]}")
        session.add(tenant)
        await session.flush()
        row = Batch(
            id=f"batch_{new_owner_id()[-8:]}",
            tenant_id=tenant.id,
            endpoint="/v1/chat/completions",
            input_file_id="file-x",
            completion_window="24h",
            status=status,
        )
        session.add(row)
        await session.commit()
        return row.id


def test_of_many_simultaneous_claims_exactly_one_wins(database_url):
    async def body(sessions):
        batch_id = await _batch(sessions)
        owners = [f"gw{i}" for i in range(8)]
        won = await asyncio.gather(*(claim(sessions, batch_id, o, 30) for o in owners))
        assert sum(won) == 1
        winner = owners[won.index(True)]
        for other in owners:  # a held lease: only its owner can claim (keep) it again
            assert await claim(sessions, batch_id, other, 30) is (other == winner)
            assert (await renew(sessions, batch_id, other, 30)) == (
                "in_progress" if other == winner else None
            )
        assert batch_id not in await claimable(sessions)
        await release(sessions, batch_id, "gw-not-the-owner")  # not the owner: no effect
        assert batch_id not in await claimable(sessions)
        await release(sessions, batch_id, winner)
        assert batch_id in await claimable(sessions)
        assert await claim(sessions, batch_id, "late", 30)

    with_db(database_url, body)


def test_an_expired_lease_is_taken_over_and_its_old_owner_told(database_url):
    async def body(sessions):
        batch_id = await _batch(sessions)
        assert await claim(sessions, batch_id, "crashed", 30)
        async with sessions() as session:  # its lease ran out (its gateway died)
            past = utcnow() - timedelta(seconds=1)
            await session.execute(
                update(Batch).where(Batch.id == batch_id).values(lease_expires_at=past)
            )
            await session.commit()
        assert await claimable(sessions) == [batch_id]
        assert await claim(sessions, batch_id, "survivor", 30)
        assert not await claim(sessions, batch_id, "crashed", 30)
        assert await renew(sessions, batch_id, "crashed", 30) is None  # it must stop
        assert await claimable(sessions) == []

    with_db(database_url, body)


def test_finished_batches_are_never_claimed(database_url):
    async def body(sessions):
        ids = {s: await _batch(sessions, s) for s in ("completed", "failed", "validating")}
        assert await claimable(sessions) == [ids["validating"]]
        assert not await claim(sessions, ids["completed"], "gw", 30)
        assert await claim(sessions, ids["validating"], "gw", 30)

    with_db(database_url, body)
