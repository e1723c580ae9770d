"""Verified tenant keys, cached: stale-while-revalidate, single flight, stale-if-error."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from loraplex.gateway.auth.principals import TenantPrincipal
from loraplex.gateway.db.errors import is_unreachable

logger = logging.getLogger(__name__)


class KeyCache:
    """Verified tenant keys by HMAC, for a short time, with one database read per key at once.

    An entry is fresh for ``ttl`` seconds. When it expires under load, every request of that
    key would otherwise wait on a database read at the same moment (all of them stalled for
    that read; a thundering herd that also churns the connection pool). So, for one more
    ``ttl``, a stale entry still answers at once while a single background read refreshes it
    (stale-while-revalidate); past that, the first miss reads and the others await its answer
    (single flight). A key revoked in the database (``loraplex keys revoke`` from another
    process) therefore stops working within ``ttl`` plus one read while it is in use; revoking
    through the admin API drops it from the cache at once.

    When that read fails because the database is unreachable (``gateway.db.errors``), a key
    verified within ``stale_if_error`` seconds is still served from the cache (RFC 5861's
    stale-if-error): requests go on while their usage is spooled. Any other key's request gets
    the failure (503 + ``Retry-After`` from the error handlers).

    Args:
        ttl: Seconds an entry is fresh (and then served stale, for as long again, while read).
        stale_if_error: Seconds after its freshness ends that an entry still answers while the
            database is unreachable.
    """

    def __init__(self, ttl: float, stale_if_error: float = 0.0) -> None:
        self.ttl = ttl
        self.stale_if_error = max(stale_if_error, ttl)
        self._entries: dict[str, tuple[float, TenantPrincipal]] = {}
        self._pending: dict[str, asyncio.Task[TenantPrincipal | None]] = {}
        self._generation = 0  # bumped by every forget: a read begun before must not cache

    async def resolve(
        self, key_hash: str, load: Callable[[], Awaitable[TenantPrincipal | None]]
    ) -> TenantPrincipal | None:
        """The cached principal, else ``load()``'s, shared by concurrent misses of one key.

        Args:
            key_hash: The key's HMAC.
            load: Reads the key from the database (None: unknown or revoked).

        Returns:
            The principal, or None for an unknown or revoked key (never cached).

        Raises:
            Whatever ``load`` raises, to every request waiting on it (a failed background
            refresh is logged; the stale entry serves until its window ends), except that
            an unreachable database serves an entry within ``stale_if_error``.
        """
        entry = self._entries.get(key_hash)
        if entry is not None:
            fresh_until, principal = entry
            now = time.monotonic()
            if now < fresh_until:
                return principal
            if now < fresh_until + self.ttl:  # stale: answer now, refresh in the background
                self._read(key_hash, load)
                return principal
            if now >= fresh_until + self.stale_if_error:
                self._entries.pop(key_hash, None)
                entry = None
        try:
            # A waiter's cancellation (its client went away) must not cancel the others' read.
            return await asyncio.shield(self._read(key_hash, load))
        except Exception as exc:
            if entry is not None and is_unreachable(exc):
                return entry[1]  # stale-if-error: verified recently, the database is down
            raise

    def _read(
        self, key_hash: str, load: Callable[[], Awaitable[TenantPrincipal | None]]
    ) -> asyncio.Task[TenantPrincipal | None]:
        """The key's read in flight, started if there is none."""
        task = self._pending.get(key_hash)
        if task is not None:
            return task
        generation = self._generation

        async def read() -> TenantPrincipal | None:
            try:
                principal = await load()
            finally:
                if self._pending.get(key_hash) is task:  # not a read begun after a forget
                    del self._pending[key_hash]
            if principal is None:
                self._entries.pop(key_hash, None)  # revoked meanwhile: no more stale answers
            elif generation == self._generation:
                self.put(key_hash, principal)
            return principal

        task = asyncio.ensure_future(read())
        task.add_done_callback(_log_failed_read)
        self._pending[key_hash] = task
        return task

    def get(self, key_hash: str) -> TenantPrincipal | None:
        """The cached principal while fresh, else None (a stale entry is :meth:`resolve`'s)."""
        hit = self._entries.get(key_hash)
        if hit is None or hit[0] <= time.monotonic():
            return None
        return hit[1]

    def put(self, key_hash: str, principal: TenantPrincipal) -> None:
        """Cache a verified key."""
        if self.ttl > 0:
            if len(self._entries) > 100_000:
                self._entries.clear()
            self._entries[key_hash] = (time.monotonic() + self.ttl, principal)

    def forget_key(self, key_id: str) -> None:
        """Drop a key (revoked); a request after this never joins a read begun before it."""
        self._generation += 1
        self._pending.clear()
        for h in [h for h, (_, p) in self._entries.items() if p.key_id == key_id]:
            self._entries.pop(h, None)

    def forget_tenant(self, tenant_id: str) -> None:
        """Drop every key of a tenant (its limits changed); later requests read afresh."""
        self._generation += 1
        self._pending.clear()
        for h in [h for h, (_, p) in self._entries.items() if p.tenant_id == tenant_id]:
            self._entries.pop(h, None)


def _log_failed_read(task: asyncio.Task) -> None:
    """Retrieve a key read's failure (waiters get it too; a background refresh has none)."""
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    if is_unreachable(exc):  # the request's 503 says it, once (gateway.errors)
        logger.debug("reading an API key failed: %s", exc)
    else:
        logger.warning("reading an API key failed: %s", exc)
