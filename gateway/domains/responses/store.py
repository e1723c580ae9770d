"""Stored responses (``store: true``): kept per tenant, bounded, read and deleted by it only.

Bounds, so that no tenant can fill the database's disk (docs/api.md, *Responses API*):

- one stored response (its Response object and the conversation it ends, images as their
  ``data:`` URLs included) is at most :data:`MAX_STORED_BYTES`; a request whose conversation
  could outgrow that (its input, plus ``max_output_tokens`` times the most bytes a token can
  stand for) is refused before it runs, with a 400 naming ``store`` (send ``store: false``);
- a tenant keeps at most :data:`MAX_PER_TENANT` responses and :data:`MAX_TENANT_BYTES` in
  all: storing one more first deletes that tenant's oldest until the new one fits (requests
  storing at the same moment may each see the room before the other's insert, so the bounds
  can be passed by at most the number of such concurrent writes, until the next store);
- each expires :data:`TTL` after it was created (OpenAI keeps responses 30 days): expired
  rows are never served and are deleted by the tenant's next store.

Every read and delete is keyed by ``(id, tenant)``: another tenant's id, an expired one and
one that never existed are the same 404, so ids do not leak existence across tenants.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.gateway.db.models import StoredResponse
from loraplex.gateway.db.types import utcnow

MAX_STORED_BYTES = 8 << 20
MAX_PER_TENANT = 1000
MAX_TENANT_BYTES = 256 << 20
TTL = timedelta(days=30)


@dataclass(frozen=True)
class Stored:
    """A stored response as read back.

    Attributes:
        body: The Response object, as the client got it.
        context: The conversation it ends: chat messages, its answer last.
    """

    body: dict[str, Any]
    context: list[dict[str, Any]]


async def load(sessions: async_sessionmaker, tenant_id: str, response_id: str) -> Stored | None:
    """The tenant's live stored response ``response_id``; None if there is none for it."""
    async with sessions() as session:
        row = await session.scalar(
            select(StoredResponse).where(
                StoredResponse.id == response_id,
                StoredResponse.tenant_id == tenant_id,
                StoredResponse.expires_at > utcnow(),
            )
        )
    if row is None:
        return None
    return Stored(body=msgspec.json.decode(row.body), context=msgspec.json.decode(row.context))


async def remove(sessions: async_sessionmaker, tenant_id: str, response_id: str) -> bool:
    """Delete the tenant's stored response ``response_id``; False if there was none for it."""
    async with sessions.begin() as session:
        result = await session.execute(
            delete(StoredResponse).where(
                StoredResponse.id == response_id,
                StoredResponse.tenant_id == tenant_id,
                StoredResponse.expires_at > utcnow(),
            )
        )
    return result.rowcount > 0


def encode(body: dict[str, Any], context: list[dict[str, Any]]) -> tuple[bytes, bytes]:
    """The two JSON texts a stored response is kept as."""
    return msgspec.json.encode(body), msgspec.json.encode(context)


async def save(
    sessions: async_sessionmaker,
    tenant_id: str,
    response_id: str,
    body: bytes,
    context: bytes,
) -> None:
    """Store one response, first deleting what the tenant's bounds require (module doc).

    Args:
        sessions: The database.
        tenant_id: Its tenant.
        response_id: ``resp_...``.
        body: The Response object, JSON.
        context: The conversation, JSON.

    Raises:
        ValueError: Larger than :data:`MAX_STORED_BYTES` (the caller checked the input before
            the run, so only a bug reaches it).
    """
    size = len(body) + len(context)
    if size > MAX_STORED_BYTES:
        raise ValueError(f"a stored response of {size} bytes exceeds {MAX_STORED_BYTES}")
    now = utcnow()
    async with sessions.begin() as session:
        await session.execute(
            delete(StoredResponse).where(
                StoredResponse.tenant_id == tenant_id, StoredResponse.expires_at <= now
            )
        )
        rows = (
            await session.execute(
                select(StoredResponse.id, StoredResponse.size_bytes)
                .where(StoredResponse.tenant_id == tenant_id)
                .order_by(StoredResponse.created_at.desc(), StoredResponse.id.desc())
            )
        ).all()
        kept, total, evict = 1, size, []
        for row_id, row_size in rows:  # newest first: keep while both bounds allow, then none
            if not evict and kept < MAX_PER_TENANT and total + row_size <= MAX_TENANT_BYTES:
                kept += 1
                total += row_size
            else:
                evict.append(row_id)
        if evict:
            await session.execute(delete(StoredResponse).where(StoredResponse.id.in_(evict)))
        session.add(
            StoredResponse(
                id=response_id,
                tenant_id=tenant_id,
                created_at=now,
                expires_at=now + TTL,
                size_bytes=size,
                body=body.decode(),
                context=context.decode(),
            )
        )
