"""Tenants' adapters by name (the ``adapters`` table); weights live in the content store.

Names are private to a tenant: every lookup is by ``(tenant_id, name)`` among live rows, so
another tenant's adapter is simply not found (404 at the API, never 403, which would leak that
the name exists).

Deleting (or replacing) soft-deletes: the row keeps its digest and gets ``deleted_at``, and the
name is free again. Whether the weights may leave the content store is a question about every
tenant's live rows (:func:`digest_in_use`): two tenants uploading the same adapter share one
digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.gateway.db.models import Adapter
from loraplex.gateway.db.types import utcnow
from loraplex.gateway.services.errors import ConflictError, NotFoundError


@dataclass(frozen=True)
class AdapterFacts:
    """What a validated adapter records in its row.

    Attributes:
        digest: The content digest (the store's key, the engine's adapter id).
        rank: Largest rank over its modules.
        lora_alpha: The config's ``lora_alpha``.
        target_modules: Projection names it adapts, sorted.
        base_model: ``base_model_name_or_path`` from its config, or None.
    """

    digest: str
    rank: int
    lora_alpha: float
    target_modules: Sequence[str]
    base_model: str | None


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


async def create_adapter(
    session: AsyncSession,
    tenant_id: str,
    name: str,
    facts: AdapterFacts,
    *,
    replace: bool = False,
) -> tuple[Adapter, Adapter | None]:
    """Record the tenant's adapter ``name``, in the caller's transaction.

    Args:
        session: In a transaction (the replace and the insert commit together).
        tenant_id: The owner.
        name: Already validated against the API's name pattern.
        facts: The validated adapter.
        replace: Soft-delete a live adapter of that name instead of refusing.

    Returns:
        ``(the new row, the row it replaced or None)``.

    Raises:
        ConflictError: the name is taken (and ``replace`` is False, or a concurrent upload took
            it first).
    """
    old = await find_adapter(session, tenant_id, name)
    if old is not None:
        if not replace:
            raise ConflictError(
                f"an adapter named {name!r} already exists (upload with ?replace=true to "
                "replace it)"
            )
        old.deleted_at = utcnow()
        await session.flush()  # free the name in the partial unique index before the insert
    row = Adapter(
        tenant_id=tenant_id,
        name=name,
        digest=facts.digest,
        rank=facts.rank,
        lora_alpha=float(facts.lora_alpha),
        target_modules=list(facts.target_modules),
        base_model=facts.base_model,
    )
    session.add(row)
    try:
        await session.flush()
    except IntegrityError:  # a concurrent upload won the name
        raise ConflictError(f"an adapter named {name!r} already exists") from None
    return row, old


async def delete_adapter(session: AsyncSession, tenant_id: str, name: str) -> Adapter:
    """Soft-delete the tenant's live adapter ``name`` (the name is free afterwards).

    Raises:
        NotFoundError: the tenant has no live adapter by that name.
    """
    row = await get_adapter(session, tenant_id, name)
    row.deleted_at = utcnow()
    await session.flush()
    return row


async def digest_in_use(session: AsyncSession, digest: str) -> bool:
    """Whether any live adapter row, of any tenant, holds ``digest``."""
    hit = await session.scalar(
        select(Adapter.id).where(Adapter.digest == digest, Adapter.deleted_at.is_(None)).limit(1)
    )
    return hit is not None
