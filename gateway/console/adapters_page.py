"""``/console/adapters``: list (size, rank, targets, digest), upload with progress, delete.

The upload and delete are the adapters API's own code paths
(``gateway.domains.adapters.controller.upload_adapter``, ``service.unregister``): the same
form, caps, validation, upload slots and engine warm-up as ``POST /v1/adapters``. A tenant
session works on its own adapters; the admin picks a tenant (``?tenant=``) and, without one,
sees every tenant's adapters.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.di import Provide
from litestar.params import FromPath, FromQuery
from sqlalchemy import select

from loraplex.gateway.console.access import ConsoleError, scope_tenant
from loraplex.gateway.console.login import CONSOLE
from loraplex.gateway.console.sessions import ConsoleSession
from loraplex.gateway.console.views import page
from loraplex.gateway.db.models import Adapter, Tenant
from loraplex.gateway.di import Injected
from loraplex.gateway.domains.adapters.controller import upload_adapter, upload_limits
from loraplex.gateway.domains.adapters.service import Adapters, provide_adapters, unregister
from loraplex.gateway.server.config import GatewayConfig
from loraplex.gateway.server.engine_client import EngineClient


def human_bytes(size: int | None) -> str:
    """``size`` bytes for people: ``"12.3 KiB"``, ``"4.0 MiB"``, ``"?"`` for None."""
    if size is None:
        return "?"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _row(adapter: Adapter, tenant_name: str, store: Any) -> dict[str, Any]:
    size = store.size(adapter.digest) if hasattr(store, "size") else None
    return {
        "tenant_id": adapter.tenant_id,
        "tenant": tenant_name,
        "name": adapter.name,
        "digest": adapter.digest,
        "rank": adapter.rank,
        "lora_alpha": adapter.lora_alpha,
        "targets": ", ".join(adapter.target_modules or []),
        "size": human_bytes(size),
        "created_at": adapter.created_at,
    }


async def _section(adapters: Adapters, tenant_id: str | None, **extra: Any) -> dict[str, Any]:
    """What ``_adapters.html`` shows: the live adapters of ``tenant_id`` (None: all)."""
    query = (
        select(Adapter, Tenant.name)
        .join(Tenant, Tenant.id == Adapter.tenant_id)
        .where(Adapter.deleted_at.is_(None))
        .order_by(Tenant.name, Adapter.name)
    )
    if tenant_id is not None:
        query = query.where(Adapter.tenant_id == tenant_id)
    async with adapters.sessions() as db:
        found = list(await db.execute(query))
        tenants = list(await db.execute(select(Tenant.id, Tenant.name).order_by(Tenant.name)))
    rows = [_row(a, name, adapters.store) for a, name in found]
    return {"adapters": rows, "tenant_id": tenant_id, "tenants": tenants, **extra}


class ConsoleAdapters(Controller):
    """The adapters page; :func:`adapters_controller` sets the upload's body limit."""

    path = "/adapters"
    dependencies = {"adapters": Provide(provide_adapters, sync_to_thread=False)}
    opt = CONSOLE

    @get("/", opt=CONSOLE)
    async def adapters_page(
        self,
        console: Injected[ConsoleSession],
        adapters: Injected[Adapters],
        config: Injected[GatewayConfig],
        tenant: FromQuery[str | None] = None,
    ) -> Response:
        """The live adapters (a tenant: its own; the admin: ``?tenant=``'s or all)."""
        tenant_id = scope_tenant(console, tenant)
        limit = upload_limits(adapters.engine, config).body_bytes
        return page(
            "adapters.html", console, **await _section(adapters, tenant_id), upload_limit=limit
        )

    @post("/", opt=CONSOLE)
    async def upload(
        self,
        request: Request,
        console: Injected[ConsoleSession],
        adapters: Injected[Adapters],
        config: Injected[GatewayConfig],
        tenant: FromQuery[str | None] = None,
        replace: FromQuery[bool] = False,
    ) -> Response:
        """Multipart ``name`` + two ``files`` or one ``archive``, as ``POST /v1/adapters``."""
        tenant_id = scope_tenant(console, tenant)
        if tenant_id is None:
            raise ConsoleError(400, "'tenant': choose the tenant the adapter is for")
        row = await upload_adapter(request, adapters, config, tenant_id, replace)
        section = await _section(adapters, tenant_id, uploaded=row.name)
        return page("_adapters.html", console, **section)

    @post("/{name:str}/delete", opt=CONSOLE)
    async def delete(
        self,
        console: Injected[ConsoleSession],
        adapters: Injected[Adapters],
        name: FromPath[str],
        tenant: FromQuery[str | None] = None,
    ) -> Response:
        """Soft-delete one adapter of the tenant (another tenant's name: 404)."""
        tenant_id = scope_tenant(console, tenant)
        if tenant_id is None:
            raise ConsoleError(400, "'tenant': choose the adapter's tenant")
        await unregister(adapters, tenant_id, name)
        return page("_adapters.html", console, **await _section(adapters, tenant_id))


def adapters_controller(engine: EngineClient, config: GatewayConfig) -> type[ConsoleAdapters]:
    """:class:`ConsoleAdapters` with the adapters API's upload body limit for this model."""
    limit = upload_limits(engine, config).body_bytes
    return type("ConsoleAdapters", (ConsoleAdapters,), {"request_max_body_size": limit})
