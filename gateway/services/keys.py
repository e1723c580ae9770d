"""API keys: issue (the plaintext is returned once), revoke, authenticate.

``authenticate`` only reads. It does not stamp ``last_used_at``: in the auth path that would turn
every request into a write transaction, and on SQLite a write taken at the start of a streamed
request holds the database's single write lock until the request ends. Instead ``touch_key`` runs
with the usage row at the end of a request (``record_usage`` calls it), and writes at most once a
``TOUCH_INTERVAL`` per key: ``last_used_at`` is accurate to a minute, at no cost per request.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy import or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.gateway.auth.keys import (
    KEY_PREFIX,
    MAX_KEY_LEN,
    display_prefix,
    generate_key,
    hash_key,
)
from loraplex.gateway.db.models import ApiKey, Tenant
from loraplex.gateway.db.types import utcnow
from loraplex.gateway.services.errors import NotFoundError

TOUCH_INTERVAL = timedelta(seconds=60)


@dataclass(frozen=True)
class IssuedKey:
    """A key just created. ``api_key`` is the only copy of the plaintext: show it once."""

    id: str
    tenant_id: str
    prefix: str
    api_key: str = field(repr=False)


class Principal(NamedTuple):
    """Who a valid key belongs to."""

    tenant: Tenant
    key: ApiKey


async def create_key(session: AsyncSession, tenant_id: str, secret: bytes) -> IssuedKey:
    """Issue a new key for the tenant; only its HMAC is stored.

    Raises:
        NotFoundError: no such tenant.
    """
    if await session.get(Tenant, tenant_id) is None:
        raise NotFoundError(f"no tenant with id {tenant_id!r}")
    plaintext = generate_key()
    key = ApiKey(
        tenant_id=tenant_id, key_hash=hash_key(plaintext, secret), prefix=display_prefix(plaintext)
    )
    session.add(key)
    await session.flush()
    return IssuedKey(id=key.id, tenant_id=tenant_id, prefix=key.prefix, api_key=plaintext)


async def get_key(session: AsyncSession, key_id: str) -> ApiKey:
    """The key with id ``key_id`` (revoked or not).

    Raises:
        NotFoundError: no such key.
    """
    key = await session.get(ApiKey, key_id)
    if key is None:
        raise NotFoundError(f"no key with id {key_id!r}")
    return key


async def list_keys(session: AsyncSession, tenant_id: str) -> list[ApiKey]:
    """The tenant's keys, revoked ones included, oldest first."""
    result = await session.scalars(
        select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at, ApiKey.id)
    )
    return list(result)


async def revoke_key(session: AsyncSession, key_id: str, *, now: datetime | None = None) -> ApiKey:
    """Revoke a key; from then on ``authenticate`` rejects it.

    Idempotent: revoking a revoked key keeps its first ``revoked_at``.

    Raises:
        NotFoundError: no such key.
    """
    key = await get_key(session, key_id)
    if key.revoked_at is None:
        key.revoked_at = now or utcnow()
        await session.flush()
    return key


async def authenticate(session: AsyncSession, api_key: str, secret: bytes) -> Principal | None:
    """The tenant and key that ``api_key`` belongs to; None if unknown or revoked.

    The key is looked up by its HMAC (an indexed equality), then the stored and computed hashes
    are compared again with ``hmac.compare_digest``. Read-only (see the module docstring).
    """
    if not api_key.startswith(KEY_PREFIX) or len(api_key) > MAX_KEY_LEN:
        return None
    key_hash = hash_key(api_key, secret)
    row = (
        await session.execute(
            select(ApiKey, Tenant)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.key_hash == key_hash)
        )
    ).first()
    if row is None:
        return None
    key, tenant = row
    if not hmac.compare_digest(key.key_hash, key_hash) or key.revoked_at is not None:
        return None
    return Principal(tenant=tenant, key=key)


async def touch_key(
    session: AsyncSession,
    key_id: str,
    *,
    now: datetime | None = None,
    interval: timedelta = TOUCH_INTERVAL,
) -> None:
    """Set the key's ``last_used_at`` to ``now`` unless it was set within ``interval``.

    One conditional UPDATE by primary key, which matches no row on most calls. Meant to run in
    the short write transaction that records a request's usage.
    """
    now = now or utcnow()
    await session.execute(
        update(ApiKey)
        .where(
            ApiKey.id == key_id,
            or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < now - interval),
        )
        .values(last_used_at=now)
        .execution_options(synchronize_session=False)
    )
