"""Adapter weights no live row references: removed safely, now or at start-up.

Weights whose removal was deferred (deleted or replaced while a running request used them; see
:mod:`gateway.domains.adapters.service`) are remembered only in the process that deferred them,
so a restart would orphan them. At start-up :func:`collect_orphans` deletes every stored adapter
that no live ``adapters`` row, of any tenant, references.

Gateways may share the store (and then share the database). One of them may be storing an
adapter for an upload whose row is not committed yet, or reusing a stored adapter this collector
is about to remove. Both sides follow one protocol, so a blob a committed live row references is
never lost:

- the collector (:func:`remove_if_unused`) stashes the adapter out of sight first, then asks the
  database whether a live row references it, and puts it back if one does;
- an upload commits its row first, then checks that the adapter is in the store and stores it
  again if not (``service.register``).

If the row commits before the collector's question, the collector puts the adapter back; if
after, the stash happened before the upload's check, which then finds it missing and stores it.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.adapters.store import AdapterStore
from loraplex.gateway.db.models import Adapter
from loraplex.gateway.services.adapters import digest_in_use

logger = logging.getLogger(__name__)


async def remove_if_unused(sessions: async_sessionmaker, store: AdapterStore, digest: str) -> bool:
    """Delete ``digest`` from the store unless a live row references it (see the module doc).

    Returns:
        Whether it was deleted.
    """
    stashed = await asyncio.to_thread(store.stash, digest)
    if stashed is None:
        return False
    async with sessions() as session:
        used = await digest_in_use(session, digest)
    if used:
        await asyncio.to_thread(store.unstash, stashed)
        return False
    await asyncio.to_thread(store.purge, stashed)
    return True


async def collect_orphans(sessions: async_sessionmaker, store: AdapterStore) -> list[str]:
    """Delete every stored adapter no live row references.

    Returns:
        The digests deleted, sorted.
    """
    async with sessions() as session:
        live = set(
            await session.scalars(select(Adapter.digest).where(Adapter.deleted_at.is_(None)))
        )
    removed = []
    for digest in store.digests():
        if digest not in live and await remove_if_unused(sessions, store, digest):
            removed.append(digest)
    if removed:
        logger.info("removed %d adapter(s) no live row references", len(removed))
    return removed


def collect_orphans_at_start(db_url: str, store: AdapterStore) -> list[str]:
    """:func:`collect_orphans` on its own database engine (before the server's loop runs).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database is unreachable.
    """
    from loraplex.gateway.db.session import make_engine, session_factory

    async def main() -> list[str]:
        engine = make_engine(db_url)
        try:
            return await collect_orphans(session_factory(engine), store)
        finally:
            await engine.dispose()

    return asyncio.run(main())
