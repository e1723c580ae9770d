"""``/admin/*``: tenants, their keys and limits (the admin key only; the README shows each)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, delete, get, post, put
from litestar.params import FromPath
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.gateway.auth.key_cache import KeyCache
from loraplex.gateway.auth.middleware import ADMIN_ONLY
from loraplex.gateway.di import Injected
from loraplex.gateway.errors import bad_request
from loraplex.gateway.services.keys import create_key, list_keys, revoke_key
from loraplex.gateway.services.tenants import (
    TenantLimits,
    create_tenant_with_key,
    get_tenant,
    limit_message,
    limits_of,
    list_tenants,
    set_limits,
)
from loraplex.gateway.transport.json_body import json_object

_LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")


def _tenant_view(tenant: Any) -> dict[str, Any]:
    return {
        "id": tenant.id,
        "name": tenant.name,
        "created_at": tenant.created_at.isoformat(),
        "limits": {f: getattr(tenant, f) for f in _LIMIT_FIELDS},
    }


def _object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    return data


def _limits(data: dict[str, Any]) -> TenantLimits:
    """The body's limits: each null or an integer in ``1..2147483647`` (400 naming it else)."""
    unknown = set(data) - set(_LIMIT_FIELDS)
    if unknown:
        raise bad_request(f"unknown limit {sorted(unknown)[0]!r}", param=sorted(unknown)[0])
    limits = TenantLimits(**{f: data.get(f) for f in _LIMIT_FIELDS})
    bad = limits.invalid_field()
    if bad is not None:
        raise bad_request(limit_message(bad), param=bad)
    return limits


class AdminController(Controller):
    """Tenant administration. Every route needs the admin key (403 for tenant keys)."""

    path = "/admin"
    opt = ADMIN_ONLY

    @post("/tenants", status_code=HTTP_201_CREATED)
    async def create_tenant(
        self, request: Request, sessions: Injected[async_sessionmaker], secret: Injected[bytes]
    ) -> dict[str, Any]:
        """``{"name", "limits"?}`` -> 201 ``{"id", "name", "api_key", "key_id"}`` (the key, once).

        ``key_id`` (beyond ``tenants create``'s first three fields) names the key for
        ``DELETE /admin/keys/{id}``.
        """
        body = await json_object(request)
        name = body.get("name")
        if not isinstance(name, str):
            raise bad_request("'name' is required and must be a string", param="name")
        limits = _limits(_object(body.get("limits") or {}))
        async with sessions() as session, session.begin():
            tenant, key = await create_tenant_with_key(session, name, secret, limits)
            return {"id": tenant.id, "name": tenant.name, "api_key": key.api_key, "key_id": key.id}

    @get("/tenants")
    async def list_tenants(self, sessions: Injected[async_sessionmaker]) -> dict[str, Any]:
        """Every tenant with its limits."""
        async with sessions() as session:
            tenants = await list_tenants(session)
            return {"object": "list", "data": [_tenant_view(t) for t in tenants]}

    @get("/tenants/{tenant_id:str}")
    async def get_tenant(
        self, sessions: Injected[async_sessionmaker], tenant_id: FromPath[str]
    ) -> dict[str, Any]:
        """One tenant, with its keys: ids, prefixes, ``revoked_at`` and ``revoked``; no hashes."""
        async with sessions() as session:
            tenant = await get_tenant(session, tenant_id)
            keys = await list_keys(session, tenant_id)
            view = _tenant_view(tenant)
            view["keys"] = [
                {
                    "id": k.id,
                    "prefix": k.prefix,
                    "created_at": k.created_at.isoformat(),
                    "revoked": k.revoked_at is not None,
                    "revoked_at": None if k.revoked_at is None else k.revoked_at.isoformat(),
                }
                for k in keys
            ]
            return view

    @put("/tenants/{tenant_id:str}/limits", status_code=HTTP_200_OK)
    async def put_limits(
        self,
        request: Request,
        sessions: Injected[async_sessionmaker],
        key_cache: Injected[KeyCache],
        default_limits: Injected[TenantLimits],
        tenant_id: FromPath[str],
    ) -> dict[str, Any]:
        """Replace the tenant's per-key limits; a null or missing field means the default."""
        limits = _limits(await json_object(request))
        async with sessions() as session, session.begin():
            tenant = await set_limits(session, tenant_id, limits)
            view = _tenant_view(tenant)
        key_cache.forget_tenant(tenant_id)
        effective = limits_of(tenant).or_defaults(default_limits)
        view["effective_limits"] = {f: getattr(effective, f) for f in _LIMIT_FIELDS}
        return view

    @post("/tenants/{tenant_id:str}/keys", status_code=HTTP_201_CREATED)
    async def create_key(
        self,
        sessions: Injected[async_sessionmaker],
        secret: Injected[bytes],
        tenant_id: FromPath[str],
    ) -> dict[str, Any]:
        """-> 201 ``{"id", "api_key"}`` (the key, once)."""
        async with sessions() as session, session.begin():
            key = await create_key(session, tenant_id, secret)
            return {"id": key.id, "api_key": key.api_key}

    @delete("/keys/{key_id:str}", status_code=HTTP_200_OK)
    async def revoke_key(
        self,
        sessions: Injected[async_sessionmaker],
        key_cache: Injected[KeyCache],
        key_id: FromPath[str],
    ) -> dict[str, Any]:
        """Revoke a key: from now on it gets 401 (the auth cache drops it at once)."""
        async with sessions() as session, session.begin():
            key = await revoke_key(session, key_id)
            out = {"id": key.id, "revoked": True}
        key_cache.forget_key(key_id)
        return out
