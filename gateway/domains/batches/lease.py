"""Which gateway runs a batch: an owner lease in the batch's row.

Several gateways may share one database (and one data directory). Each gateway's batch runner
has an owner id; it runs a batch only while it holds the batch's lease (``batches.owner``,
``batches.lease_expires_at``; migration 0005):

- **claim**: one conditional ``UPDATE ... WHERE owner IS NULL OR owner = me OR
  lease_expires_at < now``. The database makes the check and the write one atomic step (SQLite
  takes its write lock; PostgreSQL re-checks the ``WHERE`` on the row it locked), so of any
  number of gateways claiming at once exactly one gets ``rowcount == 1``.
- **renew**: ``UPDATE ... WHERE owner = me`` every third of the lease while the batch runs; a
  renewal that finds the row no longer ours (or cannot reach the database for two thirds of
  the lease) stops the run before the lease can have passed to another gateway.
- **release**: when the run ends (finished, or the gateway stopping), so another gateway or
  the next start takes the batch without waiting for the lease to run out.
- **claimable**: unfinished batches with no owner or an expired lease; each runner sweeps for
  them every half lease, so a crashed gateway's batches are taken over after at most a lease
  and a half.

Times come from each gateway's clock: the lease must be much longer than the skew between
the gateways' clocks (the default is 30 s; NTP keeps skew to milliseconds). This is the lease
scheme of Gray and Cheriton (SOSP 1989), with the database as the lock service.
"""

from __future__ import annotations

import os
import secrets
import socket
from datetime import timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.gateway.db.models import Batch
from loraplex.gateway.db.types import utcnow

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
"""Statuses of a batch that still needs a runner."""


def new_owner_id() -> str:
    """A runner's owner id: host, process and a random tag (at most 64 characters)."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(4)}"


async def claim(sessions: async_sessionmaker, batch_id: str, owner: str, lease_s: float) -> bool:
    """Take (or keep) the batch's lease for ``lease_s`` seconds.

    Returns:
        True if ``owner`` now holds it; False if another owner's lease holds, or the batch
        has ended or is gone.
    """
    now = utcnow()
    stmt = (
        update(Batch)
        .where(
            Batch.id == batch_id,
            Batch.status.in_(ACTIVE),
            or_(
                Batch.owner.is_(None),
                Batch.owner == owner,
                Batch.lease_expires_at.is_(None),
                Batch.lease_expires_at < now,
            ),
        )
        .values(owner=owner, lease_expires_at=now + timedelta(seconds=lease_s))
    )
    async with sessions() as session:
        result = await session.execute(stmt)
        await session.commit()
    return result.rowcount == 1


async def renew(
    sessions: async_sessionmaker, batch_id: str, owner: str, lease_s: float
) -> str | None:
    """Extend ``owner``'s lease by ``lease_s`` seconds from now.

    Returns:
        The batch's status (the runner watches for ``cancelling`` set by another gateway), or
        None when the lease is no longer ``owner``'s.
    """
    stmt = (
        update(Batch)
        .where(Batch.id == batch_id, Batch.owner == owner)
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
    )
    async with sessions() as session:
        result = await session.execute(stmt)
        status = await session.scalar(select(Batch.status).where(Batch.id == batch_id))
        await session.commit()
    return status if result.rowcount == 1 else None


async def release(sessions: async_sessionmaker, batch_id: str, owner: str) -> None:
    """Give the lease up (nothing if it is not ``owner``'s)."""
    stmt = (
        update(Batch)
        .where(Batch.id == batch_id, Batch.owner == owner)
        .values(owner=None, lease_expires_at=None)
    )
    async with sessions() as session:
        await session.execute(stmt)
        await session.commit()


async def claimable(sessions: async_sessionmaker) -> list[str]:
    """Unfinished batches no live lease holds, oldest first."""
    now = utcnow()
    stmt = (
        select(Batch.id)
        .where(
            Batch.status.in_(ACTIVE),
            or_(
                Batch.owner.is_(None),
                Batch.lease_expires_at.is_(None),
                Batch.lease_expires_at < now,
            ),
        )
        .order_by(Batch.created_at)
    )
    async with sessions() as session:
        return list((await session.scalars(stmt)).all())
