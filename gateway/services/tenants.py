"""Tenants: create, look up, list, and set per-tenant limits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.gateway.db.models import Tenant
from loraplex.gateway.services.errors import ConflictError, InvalidInputError, NotFoundError
from loraplex.gateway.services.keys import IssuedKey, create_key

MAX_NAME_LEN = 128
MAX_LIMIT = 2**31 - 1
"""Largest value of a tenant limit: the ``tenants`` columns are SQL ``INTEGER`` (32-bit signed on
PostgreSQL), so every stored limit is in ``1..2147483647``."""


@dataclass(frozen=True)
class TenantLimits:
    """Per-key limits; None means "no tenant-specific value" (use the server default).

    Each value is None or an integer in ``1..MAX_LIMIT`` (2,147,483,647).
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None

    def invalid_field(self) -> str | None:
        """The first field that is neither None nor an integer in ``1..MAX_LIMIT``, or None."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (value is None or (type(value) is int and 1 <= value <= MAX_LIMIT)):
                return field.name
        return None

    def validate(self) -> None:
        """Raise ``InvalidInputError`` unless every value is None or an int in ``1..MAX_LIMIT``."""
        name = self.invalid_field()
        if name is not None:
            raise InvalidInputError(limit_message(name))

    def or_defaults(self, defaults: TenantLimits) -> TenantLimits:
        """These limits, with each None replaced by the value in ``defaults``."""
        return TenantLimits(
            **{
                f.name: getattr(defaults, f.name)
                if getattr(self, f.name) is None
                else getattr(self, f.name)
                for f in dataclasses.fields(self)
            }
        )


def limit_message(name: str) -> str:
    """What a bad value of the limit ``name`` is told."""
    return f"{name} must be null or an integer from 1 to {MAX_LIMIT}"


def limits_of(tenant: Tenant) -> TenantLimits:
    """The limits stored on ``tenant`` (None where the server default applies)."""
    return TenantLimits(
        requests_per_minute=tenant.requests_per_minute,
        tokens_per_minute=tenant.tokens_per_minute,
        max_concurrent_requests=tenant.max_concurrent_requests,
    )


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InvalidInputError("tenant name must be a non-empty string")
    if len(name) > MAX_NAME_LEN or not name.isprintable():
        raise InvalidInputError(f"tenant name must be printable, at most {MAX_NAME_LEN} chars")
    return name


async def create_tenant(
    session: AsyncSession, name: str, limits: TenantLimits | None = None
) -> Tenant:
    """Add a tenant named ``name``.

    Raises:
        ConflictError: a tenant with that name exists.
        InvalidInputError: bad name or limits.
    """
    name = _check_name(name)
    limits = limits or TenantLimits()
    limits.validate()
    if await get_tenant_by_name(session, name) is not None:
        raise ConflictError(f"tenant name {name!r} is taken")
    tenant = Tenant(name=name, **dataclasses.asdict(limits))
    session.add(tenant)
    try:
        await session.flush()
    except IntegrityError:  # a concurrent create won the race
        raise ConflictError(f"tenant name {name!r} is taken") from None
    return tenant


async def create_tenant_with_key(
    session: AsyncSession, name: str, secret: bytes, limits: TenantLimits | None = None
) -> tuple[Tenant, IssuedKey]:
    """Add a tenant and issue its first key, in the caller's transaction.

    This is ``POST /admin/tenants`` and ``loraplex tenants create``.

    Raises:
        ConflictError: a tenant with that name exists.
        InvalidInputError: bad name or limits.
    """
    tenant = await create_tenant(session, name, limits)
    return tenant, await create_key(session, tenant.id, secret)


async def get_tenant(session: AsyncSession, tenant_id: str) -> Tenant:
    """The tenant with id ``tenant_id``.

    Raises:
        NotFoundError: no such tenant.
    """
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFoundError(f"no tenant with id {tenant_id!r}")
    return tenant


async def get_tenant_by_name(session: AsyncSession, name: str) -> Tenant | None:
    """The tenant named ``name``, or None."""
    return await session.scalar(select(Tenant).where(Tenant.name == name))


async def list_tenants(session: AsyncSession) -> list[Tenant]:
    """Every tenant, oldest first."""
    result = await session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.id))
    return list(result)


async def set_limits(session: AsyncSession, tenant_id: str, limits: TenantLimits) -> Tenant:
    """Replace the tenant's limits (a None clears that limit back to the server default).

    Raises:
        NotFoundError: no such tenant.
        InvalidInputError: a limit is not null or an integer in ``1..MAX_LIMIT``.
    """
    limits.validate()
    tenant = await get_tenant(session, tenant_id)
    for field, value in dataclasses.asdict(limits).items():
        setattr(tenant, field, value)
    await session.flush()
    return tenant
