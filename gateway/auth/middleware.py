"""Authentication (Litestar's authentication middleware) and which keys each route takes.

Every route needs ``Authorization: Bearer <key>`` except those marked ``exclude_from_auth``
(``/health``, ``/version``; ``/docs``, ``/docs/*`` and ``/openapi.json``:
``gateway.server.docs``). The middleware resolves the key to a ``TenantPrincipal`` (a tenant
key, ``lpx-...``, looked up by its HMAC in the database) or ``AdminPrincipal`` (the admin key,
compared in constant time; both in ``gateway.auth.principals``) and puts it on ``request.user``.
It then keeps the admin key on routes marked ``opt=ADMIN_ONLY`` (``/admin/*``, ``/metrics``) and
tenant keys off them (403 either way); every other route takes tenant keys only. The check is
the route handler's ``opt`` read in the middleware rather than a Litestar guard, which would
copy the handler on every request (``BaseRouteHandler.authorize_connection``). Verified tenant
keys are cached for ``auth_cache_seconds`` (a database read saved per request,
``auth.key_cache``); revoking a key through the admin API drops it from the cache at once. Keys
never reach a log: only the key id does. A client address with too many failed attempts (401)
gets 429 with ``Retry-After`` before its key is even hashed
(:class:`gateway.limits.auth_throttle.AuthThrottle`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol

from litestar.connection import ASGIConnection
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult
from litestar.types import ASGIApp
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.gateway.auth.key_cache import KeyCache
from loraplex.gateway.auth.keys import hash_key
from loraplex.gateway.auth.principals import AdminPrincipal, TenantPrincipal
from loraplex.gateway.auth.secrets_store import verify_admin_key
from loraplex.gateway.errors import APIError
from loraplex.gateway.limits.auth_throttle import AuthThrottle, client_group
from loraplex.gateway.metrics.registry import GatewayMetrics
from loraplex.gateway.services.keys import authenticate
from loraplex.gateway.services.tenants import limits_of
from loraplex.gateway.transport.http_protocol import exchange_of

AUTH_HEADER = "authorization"
KEY_AREA = "key_area"  # route handler ``opt`` key: which keys the route takes
ADMIN_ONLY = {KEY_AREA: "admin"}  # ``opt`` of the admin routes; any other route: tenant keys
logger = logging.getLogger(__name__)


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


class KeyAuth(Protocol):
    """What the auth middleware reads (``GatewayState`` is one), handed to it at construction.

    Middleware runs before Litestar resolves a handler's dependencies, so it cannot take them
    as parameters; :func:`gateway.server.app.create_app` passes the app's state to the
    middleware's constructor as this instead (``DefineMiddleware(KeyAuthMiddleware,
    auth=...)``). Read on every request, so a service replaced on the state is seen at once.

    Attributes:
        admin_key: The admin key (never logged).
        secret: Server secret for key HMACs.
        sessions: Async session factory (a tenant key's lookup).
        key_cache: Verified keys.
        auth_throttle: Failed authentications per client address.
        metrics: Counters (``max_connections_per_key`` refusals).
    """

    admin_key: str
    secret: bytes
    sessions: async_sessionmaker
    key_cache: KeyCache
    auth_throttle: AuthThrottle
    metrics: GatewayMetrics


class KeyAuthMiddleware(AbstractAuthenticationMiddleware):
    """Resolves the bearer key to a principal on ``request.user`` (401 when it cannot).

    Args:
        app: The next ASGI app.
        auth: The keys, cache and throttle it checks against.
        **options: ``AbstractAuthenticationMiddleware``'s (``exclude_from_auth_key``, ...).
    """

    def __init__(self, app: ASGIApp, auth: KeyAuth, **options: Any) -> None:
        super().__init__(app, **options)
        self.auth = auth

    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        """See the module docstring.

        Raises:
            APIError: 401 for a missing, malformed, unknown or revoked key (counted against the
                client's address); 429 ``too_many_failed_authentications`` with
                ``Retry-After`` while that address is throttled; 403 for the admin key on a
                tenant route (``tenant_only``) or a tenant key on an admin route
                (``admin_only``).
        """
        auth = self.auth
        throttle = auth.auth_throttle
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
            return await self._authenticate(connection, auth)
        except APIError as exc:
            if exc.status == 401:
                throttle.failed(client)
            raise

    async def _authenticate(
        self, connection: ASGIConnection, auth: KeyAuth
    ) -> AuthenticationResult:
        token = bearer_token(connection)
        admin_route = connection.route_handler.opt.get(KEY_AREA) == "admin"
        principal = await resolve_key(auth, token)
        if principal is None:
            raise APIError(401, "invalid API key (unknown or revoked)")
        if isinstance(principal, AdminPrincipal):
            if not admin_route:
                raise APIError(
                    403,
                    "the admin key serves /admin/* and /metrics only; use a tenant key",
                    code="tenant_only",
                )
            return AuthenticationResult(user=principal, auth=None)
        if admin_route:
            raise APIError(403, "this route needs the admin key", code="admin_only")
        claim_connection(connection, auth.metrics, principal)
        return AuthenticationResult(user=principal, auth=None)


async def resolve_key(auth: KeyAuth, token: str) -> AdminPrincipal | TenantPrincipal | None:
    """Who ``token`` is: the admin key, a live tenant key (through the key cache), or None.

    The admin key is compared in constant time; a tenant key is looked up by its HMAC
    (``services.keys.authenticate``) and cached for ``auth_cache_seconds``. The API's auth
    middleware and the console's login (``gateway.console.access``) both call this.
    """
    if verify_admin_key(token, auth.admin_key):
        return AdminPrincipal()
    key_hash = hash_key(token, auth.secret)

    async def load() -> TenantPrincipal | None:
        async with auth.sessions() as session:
            found = await authenticate(session, token, auth.secret)
        if found is None:
            return None
        return TenantPrincipal(
            tenant_id=found.tenant.id,
            tenant_name=found.tenant.name,
            key_id=found.key.id,
            limits=limits_of(found.tenant),
        )

    return await auth.key_cache.resolve(key_hash, load)


def claim_connection(
    connection: ASGIConnection, metrics: GatewayMetrics, principal: TenantPrincipal
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
    metrics.rate_limited.labels(principal.tenant_id, "max_connections_per_key").inc()
    raise APIError(
        429,
        "too many open connections for this API key; close idle ones or retry later",
        code="too_many_connections",
        headers={"Retry-After": "1", "Connection": "close"},
    )
