"""Authentication (Litestar's authentication middleware) and which keys each route takes.

Every route needs ``Authorization: Bearer <key>`` except those marked ``exclude_from_auth``
(``/health``, ``/version``). The middleware resolves the key to a :class:`TenantPrincipal`
(a tenant key, ``lpx-...``, looked up by its HMAC in the database) or :class:`AdminPrincipal`
(the admin key, compared in constant time) and puts it on ``request.user``. It then keeps the
admin key on routes marked ``opt=ADMIN_ONLY`` (``/admin/*``, ``/metrics``) and tenant keys off
them (403 either way); every other route takes tenant keys only. The check is the route
handler's ``opt`` read in the middleware rather than a Litestar guard, which would copy the
handler on every request (``BaseRouteHandler.authorize_connection``). Verified tenant keys
are cached for ``auth_cache_seconds`` (a database read saved per request; see :class:`KeyCache`);
revoking a key through the admin API drops it from the cache at once. Keys never reach a log:
only the key id does. A client address with too many failed attempts (401) gets 429 with
``Retry-After`` before its key is even hashed (:class:`gateway.limits.auth_throttle.AuthThrottle`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from litestar.connection import ASGIConnection
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult

from loraplex.gateway.auth.keys import hash_key
from loraplex.gateway.auth.secrets_store import verify_admin_key
from loraplex.gateway.db.errors import is_unreachable
from loraplex.gateway.errors import APIError
from loraplex.gateway.limits.auth_throttle import client_group
from loraplex.gateway.services.keys import authenticate
from loraplex.gateway.services.tenants import TenantLimits, limits_of
from loraplex.gateway.transport.http_protocol import exchange_of

if TYPE_CHECKING:
    from loraplex.gateway.server.state import GatewayState

AUTH_HEADER = "authorization"
KEY_AREA = "key_area"  # route handler ``opt`` key: which keys the route takes
ADMIN_ONLY = {KEY_AREA: "admin"}  # ``opt`` of the admin routes; any other route: tenant keys
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TenantPrincipal:
    """The caller behind a valid tenant key.

    Attributes:
        tenant_id: The tenant (also the engine requests' cache salt).
        tenant_name: Its name.
        key_id: The key's id (usage rows, rate limits, logs).
        limits: The tenant's own limits (None fields: the server defaults apply).
    """

    tenant_id: str
    tenant_name: str
    key_id: str
    limits: TenantLimits


@dataclass(frozen=True)
class AdminPrincipal:
    """The caller presented the admin key."""


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


def bearer_token(connection: ASGIConnection) -> str:
    """The token of ``Authorization: Bearer <token>``.

    Raises:
        APIError: 401 when the header is missing or not a bearer token.
    """
    header = connection.headers.get(AUTH_HEADER)
    if not header:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise APIError(401, "malformed Authorization header: expected 'Bearer <key>'")
    return token


class KeyAuthMiddleware(AbstractAuthenticationMiddleware):
    """Resolves the bearer key to a principal on ``request.user`` (401 when it cannot)."""

    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        """See the module docstring.

        Raises:
            APIError: 401 for a missing, malformed, unknown or revoked key (counted against the
                client's address); 429 ``too_many_failed_authentications`` with
                ``Retry-After`` while that address is throttled; 403 for the admin key on a
                tenant route (``tenant_only``) or a tenant key on an admin route
                (``admin_only``).
        """
        state = connection.app.state.gateway
        throttle = state.auth_throttle
        client = client_group(connection.scope.get("client"))
        wait = throttle.retry_after(client)
        if wait is not None:
            raise APIError(
                429,
                "too many failed authentication attempts from this address; retry after "
                f"{math.ceil(wait)} s",
                code="too_many_failed_authentications",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )
        try:
            return await self._authenticate(connection, state)
        except APIError as exc:
            if exc.status == 401:
                throttle.failed(client)
            raise

    async def _authenticate(
        self, connection: ASGIConnection, state: GatewayState
    ) -> AuthenticationResult:
        token = bearer_token(connection)
        admin_route = connection.route_handler.opt.get(KEY_AREA) == "admin"
        if verify_admin_key(token, state.admin_key):
            if not admin_route:
                raise APIError(
                    403,
                    "the admin key serves /admin/* and /metrics only; use a tenant key",
                    code="tenant_only",
                )
            return AuthenticationResult(user=AdminPrincipal(), auth=None)
        key_hash = hash_key(token, state.secret)

        async def load() -> TenantPrincipal | None:
            async with state.sessions() as session:
                found = await authenticate(session, token, state.secret)
            if found is None:
                return None
            return TenantPrincipal(
                tenant_id=found.tenant.id,
                tenant_name=found.tenant.name,
                key_id=found.key.id,
                limits=limits_of(found.tenant),
            )

        principal = await state.key_cache.resolve(key_hash, load)
        if principal is None:
            raise APIError(401, "invalid API key (unknown or revoked)")
        if admin_route:
            raise APIError(403, "this route needs the admin key", code="admin_only")
        claim_connection(connection, state, principal)
        return AuthenticationResult(user=principal, auth=None)


def claim_connection(
    connection: ASGIConnection, state: GatewayState, principal: TenantPrincipal
) -> None:
    """Count the request's connection as serving the principal's key (issue 27).

    One key holds at most its share of the server's connection table
    (``--max-connections-per-key``; ``gateway.transport.connections.ConnectionTable.claim``), so
    that one key's parked connections cannot fill it for every other tenant. Does nothing
    outside ``LimitedHttpProtocol`` (no ``Exchange`` in the scope).

    Raises:
        APIError: 429 ``too_many_connections`` with ``Retry-After: 1`` and ``Connection:
            close`` when the key holds its share and none of its connections is idle
            (counted in ``loraplex_rate_limited_requests`` as ``max_connections_per_key``).
    """
    exchange = exchange_of(connection.scope)
    if exchange is None or exchange.serve_key(principal.key_id):
        return
    state.metrics.rate_limited.labels(principal.tenant_id, "max_connections_per_key").inc()
    raise APIError(
        429,
        "too many open connections for this API key; close idle ones or retry later",
        code="too_many_connections",
        headers={"Retry-After": "1", "Connection": "close"},
    )
