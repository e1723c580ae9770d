"""Adapters across their three homes: the content store, the database and the engine.

Upload: validate and store the weights (a worker thread), record the name (one transaction,
replacing the old row when asked), then hand the adapter to the engine so the first chat does
not pay a cold load. Delete: soft-delete the row; when no live row of any tenant holds the
digest any more, drop it from the engine and from the store. While a running request still
uses it the engine refuses, and the weights stay (a preempted request may need to reload them);
the digest is remembered and collected by the next upload or delete once the engine lets go,
or at the next start-up (:mod:`gateway.domains.adapters.orphans`). Both hold one lock per app
around the store-and-database step, and weights leave the store only by the orphans protocol
(stash, re-check the database, purge or restore; an upload re-checks the store after its row
commits), so neither this gateway nor one sharing the store can remove weights a committed
live row references.

A chat request that resolved a name just before its delete may reach the engine after the
weights left: the engine then finishes it as aborted (no request ever switches adapter).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.adapters.store import DigestStore
from loraplex.adapters.validation import LoraAdapter
from loraplex.gateway.db.models import Adapter
from loraplex.gateway.di import Injected
from loraplex.gateway.domains.adapters.orphans import remove_if_unused
from loraplex.gateway.server.engine_client import EngineClient
from loraplex.gateway.services.adapters import (
    AdapterFacts,
    create_adapter,
    delete_adapter,
    digest_in_use,
    find_adapter,
)
from loraplex.gateway.services.errors import ConflictError

logger = logging.getLogger(__name__)

DEFAULT_UPLOAD_SLOTS = 2


@dataclass
class Registry:
    """Per-app bookkeeping of adapter changes.

    Attributes:
        lock: Held around every store-and-table change.
        pending: Digests no live row holds whose removal a running request refused.
        uploads: Slots for upload processing (reading back, unpacking, validating, storing):
            at most this many uploads hold their files in memory at once, however many
            arrive; the others wait holding only their spool files on disk.
    """

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pending: set[str] = field(default_factory=set)
    uploads: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(DEFAULT_UPLOAD_SLOTS)
    )


@dataclass(frozen=True)
class Adapters:
    """What the adapter routes work with (a Litestar dependency, built from the app's).

    Attributes:
        engine: The engine (adapter limits, warm-up, removal).
        sessions: Async session factory.
        store: The content-addressed adapter store (on disk or in an object store).
        registry: The app's adapter bookkeeping (``GatewayState.adapters``).
    """

    engine: EngineClient
    sessions: async_sessionmaker
    store: DigestStore
    registry: Registry


def provide_adapters(
    engine: Injected[EngineClient],
    sessions: Injected[async_sessionmaker],
    store: Injected[DigestStore],
    adapter_registry: Injected[Registry],
) -> Adapters:
    """The ``adapters`` dependency: the app's dependencies the adapter routes use."""
    return Adapters(engine, sessions, store, adapter_registry)


async def ensure_name_free(adapters: Adapters, tenant_id: str, name: str) -> None:
    """Refuse a taken name before any validation work (re-checked on insert).

    Raises:
        ConflictError: the tenant has a live adapter called ``name``.
    """
    async with adapters.sessions() as session:
        if await find_adapter(session, tenant_id, name) is not None:
            raise ConflictError(
                f"an adapter named {name!r} already exists (upload with ?replace=true to "
                "replace it)"
            )


async def store_adapter(
    adapters: Adapters, config_bytes: bytes, weights_bytes: bytes
) -> LoraAdapter:
    """Validate against the served model and store, in a worker thread.

    Raises:
        AdapterError: the adapter is refused; the store is unchanged.
    """
    limits = adapters.engine.adapter_limits
    return await asyncio.to_thread(
        adapters.store.put_files,
        config_bytes,
        weights_bytes,
        limits=limits,
    )


async def register(
    adapters: Adapters,
    tenant_id: str,
    name: str,
    config_bytes: bytes,
    weights_bytes: bytes,
    *,
    replace: bool,
) -> Adapter:
    """Validate, store and record an upload; warm it in the engine.

    Returns:
        The new row.

    Raises:
        AdapterError: the adapter is refused (the store is unchanged).
        ConflictError: the name is taken and ``replace`` is False.
    """
    adapter = await store_adapter(adapters, config_bytes, weights_bytes)
    async with adapters.registry.lock:
        try:
            async with adapters.sessions() as session, session.begin():
                row, old = await create_adapter(
                    session,
                    tenant_id,
                    name,
                    AdapterFacts(
                        digest=adapter.digest,
                        rank=adapter.rank,
                        lora_alpha=adapter.lora_alpha,
                        target_modules=adapter.target_modules,
                        base_model=adapter.base_model,
                    ),
                    replace=replace,
                )
        except ConflictError:
            await _collect(adapters, adapter.digest)  # only if no live row holds it
            raise
        # the row is committed: if a collector (here or in a gateway sharing the store) removed
        # the weights since they were stored, store them again (orphans.py's protocol)
        if not adapters.store.has(adapter.digest):
            adapter = await store_adapter(adapters, config_bytes, weights_bytes)
        if old is not None and old.digest != row.digest:
            await _collect(adapters, old.digest)
        await _retry_pending(adapters)
    try:
        await adapters.engine.add_lora(adapter)
    except Exception as exc:  # the store has it: the engine loads it on first use
        logger.warning("could not pre-load adapter %s: %r", adapter.digest, exc)
    return row


async def unregister(adapters: Adapters, tenant_id: str, name: str) -> Adapter:
    """Soft-delete the tenant's adapter and release its weights if nobody else holds them.

    Raises:
        NotFoundError: the tenant has no live adapter by that name.
    """
    async with adapters.registry.lock:
        async with adapters.sessions() as session, session.begin():
            row = await delete_adapter(session, tenant_id, name)
        await _collect(adapters, row.digest)
        await _retry_pending(adapters)
    return row


async def _collect(adapters: Adapters, digest: str) -> None:
    """Drop ``digest`` from engine and store when no live row holds it (caller holds the lock).

    The weights stay, and the digest goes to ``adapters.registry.pending``, while a running request
    uses them (the engine refuses the removal) or when the engine cannot be asked.
    """
    adapters.registry.pending.discard(digest)
    async with adapters.sessions() as session:
        if await digest_in_use(session, digest):
            return
    try:
        removed = await adapters.engine.remove_lora(digest)
    except Exception as exc:
        logger.warning("could not remove adapter %s from the engine: %r", digest, exc)
        removed = False
    if not removed:
        adapters.registry.pending.add(digest)
        return
    await remove_if_unused(adapters.sessions, adapters.store, digest)


async def _retry_pending(adapters: Adapters) -> None:
    """Collect digests whose removal was refused earlier (caller holds the lock)."""
    for digest in sorted(adapters.registry.pending):
        await _collect(adapters, digest)
