"""Tenants' adapters by name (the ``adapters`` table); weights live in the content store.

Names are private to a tenant: every lookup is by ``(tenant_id, name)`` among live rows, so
another tenant's adapter is simply not found (404 at the API, never 403, which would leak that
the name exists).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db.models import Adapter
from gateway.services.errors import NotFoundError


async def find_adapter(session: AsyncSession, tenant_id: str, name: str) -> Adapter | None:
    """The tenant's live adapter called ``name``, or None."""
    return await session.scalar(
        select(Adapter).where(
            Adapter.tenant_id == tenant_id, Adapter.name == name, Adapter.deleted_at.is_(None)
        )
    )


async def get_adapter(session: AsyncSession, tenant_id: str, name: str) -> Adapter:
    """The tenant's live adapter called ``name``.

    Raises:
        NotFoundError: the tenant has no live adapter by that name.
    """
    adapter = await find_adapter(session, tenant_id, name)
    if adapter is None:
        raise NotFoundError(f"the adapter {name!r} does not exist")
    return adapter


async def list_adapters(session: AsyncSession, tenant_id: str) -> list[Adapter]:
    """The tenant's live adapters, by name."""
    rows = await session.scalars(
        select(Adapter)
        .where(Adapter.tenant_id == tenant_id, Adapter.deleted_at.is_(None))
        .order_by(Adapter.name)
    )
    return list(rows)
