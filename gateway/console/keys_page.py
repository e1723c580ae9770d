"""``/console/keys``: tenants (admin) and keys: list with ids, create, revoke.

The changes go through the admin API's own operations (``gateway.services.tenants``,
``gateway.services.keys``) and, like ``DELETE /admin/keys/{id}``, a revoked key leaves the auth
cache at once; its console sessions end too. A tenant session manages its own tenant's keys
only: another tenant's key id is a 404, the same as an unknown one, and holds at most
``MAX_TENANT_KEYS`` live keys (each key holds its own share of the server's connections,
``--max-connections-per-key``, so keys a tenant mints itself must be bounded).
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.params import FromPath, FromQuery
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.gateway.auth.key_cache import KeyCache
from loraplex.gateway.console.access import ConsoleError, scope_tenant
from loraplex.gateway.console.login import CONSOLE
from loraplex.gateway.console.sessions import ConsoleSession, ConsoleSessions
from loraplex.gateway.console.views import page
from loraplex.gateway.db.models import ApiKey
from loraplex.gateway.di import Injected
from loraplex.gateway.services.errors import NotFoundError
from loraplex.gateway.services.keys import create_key, get_key, list_keys, revoke_key
from loraplex.gateway.services.tenants import create_tenant_with_key, get_tenant, list_tenants

MAX_FIELD = 256
MAX_TENANT_KEYS = 16  # live keys a tenant session may hold (the admin's creations: no bound)


async def _section(
    console: Injected[ConsoleSession],
    sessions: async_sessionmaker,
    tenant_id: str | None,
    **extra: Any,
) -> dict[str, Any]:
    """What ``_keys.html`` shows: the tenants (admin) and the chosen tenant's keys."""
    async with sessions() as db:
        tenants = await list_tenants(db) if console.admin else []
        tenant = keys = None
        if tenant_id is not None:
            tenant = await get_tenant(db, tenant_id)
            keys = await list_keys(db, tenant_id)
    return {"tenants": tenants, "tenant": tenant, "keys": keys, **extra}


@get("/keys", opt=CONSOLE)
async def keys_page(
    console: Injected[ConsoleSession],
    sessions: Injected[async_sessionmaker],
    tenant: FromQuery[str | None] = None,
) -> Response:
    """The tenants (admin) and one tenant's keys (a tenant: its own)."""
    tenant_id = scope_tenant(console, tenant)
    return page("keys.html", console, **await _section(console, sessions, tenant_id))


@post("/tenants", opt=CONSOLE)
async def create_tenant(
    request: Request,
    console: Injected[ConsoleSession],
    sessions: Injected[async_sessionmaker],
    secret: Injected[bytes],
) -> Response:
    """Form ``name`` -> a new tenant and its first key, shown once (the admin only)."""
    if not console.admin:
        raise ConsoleError(403, "refused: creating tenants needs the admin key")
    name = (await request.form()).get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_FIELD:
        raise ConsoleError(400, "'name': enter a tenant name (at most 128 characters)")
    async with sessions() as db, db.begin():
        tenant, key = await create_tenant_with_key(db, name.strip(), secret)
        tenant_id, new_key = tenant.id, key.api_key
    section = await _section(console, sessions, tenant_id, new_key=new_key)
    return page("_keys.html", console, **section)


@post("/keys", opt=CONSOLE)
async def new_key(
    console: Injected[ConsoleSession],
    sessions: Injected[async_sessionmaker],
    secret: Injected[bytes],
    tenant: FromQuery[str | None] = None,
) -> Response:
    """A new key for the tenant (``?tenant=`` for the admin; a tenant: its own), shown once.

    Raises:
        ConsoleError: 400 without a tenant; 409 for a tenant session whose tenant already
            holds ``MAX_TENANT_KEYS`` live keys.
    """
    tenant_id = scope_tenant(console, tenant)
    if tenant_id is None:
        raise ConsoleError(400, "'tenant': choose a tenant first")
    async with sessions() as db, db.begin():
        if not console.admin:
            live = await db.scalar(
                select(func.count())
                .select_from(ApiKey)
                .where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))
            )
            if live >= MAX_TENANT_KEYS:
                raise ConsoleError(
                    409, f"a tenant holds at most {MAX_TENANT_KEYS} live keys; revoke one first"
                )
        issued = await create_key(db, tenant_id, secret)
    section = await _section(console, sessions, tenant_id, new_key=issued.api_key)
    return page("_keys.html", console, **section)


@post("/keys/{key_id:str}/revoke", opt=CONSOLE)
async def revoke(
    console: Injected[ConsoleSession],
    sessions: Injected[async_sessionmaker],
    key_cache: Injected[KeyCache],
    console_sessions: Injected[ConsoleSessions],
    key_id: FromPath[str],
) -> Response:
    """Revoke a key (a tenant: one of its own; another's is a 404 like an unknown id)."""
    async with sessions() as db, db.begin():
        key = await get_key(db, key_id)
        if not console.admin and key.tenant_id != console.tenant_id:
            raise NotFoundError(f"no key with id {key_id!r}")
        await revoke_key(db, key_id)
        tenant_id = key.tenant_id
    key_cache.forget_key(key_id)
    console_sessions.end_key(key_id)
    if console.key_id == key_id:  # a tenant revoked its own login key: the session is over
        return Response("", status_code=200, headers={"HX-Redirect": "/console/login"})
    return page("_keys.html", console, **await _section(console, sessions, tenant_id))
