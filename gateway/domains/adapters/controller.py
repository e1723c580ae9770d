"""``/v1/adapters``: a tenant's LoRA adapters (upload, list, get, delete; docs/adapters.md).

Every route takes a tenant key (``gateway.auth.middleware``) and sees only that tenant's adapters:
another tenant's name is a 404, exactly like a name that does not exist. The upload route's body
limit is the largest valid adapter for the served model plus room for framing
(:class:`gateway.domains.adapters.limits.UploadLimits`), at most
``GatewayConfig.upload_max_body_bytes`` (the app's default is the smaller chat limit), set on
this controller when the app registers it; 413 beyond.

An upload streams to spool files on disk first (no slot held), then takes one of
``GatewayConfig.max_concurrent_uploads`` processing slots to read its two files back (or unpack
its archive), validate and store them, so N concurrent hostile uploads hold at most that many
adapters' worth of memory.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from litestar import Controller, Request, Response, delete, get, post
from litestar.di import Provide
from litestar.params import FromPath, FromQuery
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.adapters.errors import AdapterError
from loraplex.gateway.db.models import Adapter
from loraplex.gateway.di import Injected
from loraplex.gateway.domains.adapters.form import read_form
from loraplex.gateway.domains.adapters.limits import UploadLimits
from loraplex.gateway.domains.adapters.service import (
    Adapters,
    ensure_name_free,
    provide_adapters,
    register,
    unregister,
)
from loraplex.gateway.domains.adapters.upload import adapter_bytes, check_name, check_shape
from loraplex.gateway.domains.adapters.views import adapter_view, list_body
from loraplex.gateway.errors import APIError
from loraplex.gateway.server.config import GatewayConfig
from loraplex.gateway.server.engine_client import EngineClient
from loraplex.gateway.services.adapters import get_adapter, list_adapters
from loraplex.gateway.settings import private_dir

UPLOAD_SPOOL_SUBDIR = "uploads"
"""Where upload parts are spooled, under the data directory (mode 0700; files anonymous)."""


def upload_limits(engine: EngineClient, config: GatewayConfig) -> UploadLimits:
    """The upload caps for the app's served model and settings."""
    return UploadLimits.derive(engine.adapter_limits, config)


def spool_dir(config: GatewayConfig) -> Path:
    """The data directory's upload spool (made 0700 if missing)."""
    return private_dir(Path(config.data_dir) / UPLOAD_SPOOL_SUBDIR)


class AdapterController(Controller):
    """Upload, list, get and delete the calling tenant's adapters.

    Registered through :func:`adapter_controller`, which sets the upload route's body limit.
    """

    path = "/v1/adapters"
    dependencies = {"adapters": Provide(provide_adapters, sync_to_thread=False)}

    @post("/", status_code=HTTP_201_CREATED)
    async def upload(
        self,
        request: Request,
        adapters: Injected[Adapters],
        config: Injected[GatewayConfig],
        replace: FromQuery[bool] = False,
    ) -> Response:
        """Multipart ``name`` + ``files`` (two) or ``archive`` (one) -> 201 the adapter.

        ``?replace=true`` replaces a live adapter of that name (the old row is soft-deleted and
        the new one recorded in one transaction); otherwise a taken name is a 409.

        Raises:
            APIError: 400 bad name, form, archive or adapter (the validator's message); 409
                name taken; 413 body over the upload limit.
        """
        row = await upload_adapter(request, adapters, config, request.user.tenant_id, replace)
        return Response(adapter_view(row), status_code=HTTP_201_CREATED)

    @get("/")
    async def list_adapters(
        self, request: Request, sessions: Injected[async_sessionmaker]
    ) -> dict[str, Any]:
        """The tenant's live adapters, by name, in OpenAI's list shape."""
        async with sessions() as session:
            rows = await list_adapters(session, request.user.tenant_id)
        return list_body([adapter_view(row) for row in rows])

    @get("/{name:str}")
    async def get_adapter(
        self, request: Request, sessions: Injected[async_sessionmaker], name: FromPath[str]
    ) -> dict[str, Any]:
        """One adapter of the tenant (404 if absent or another tenant's)."""
        async with sessions() as session:
            row = await get_adapter(session, request.user.tenant_id, name)
        return adapter_view(row)

    @delete("/{name:str}", status_code=HTTP_200_OK)
    async def delete_adapter(
        self, request: Request, adapters: Injected[Adapters], name: FromPath[str]
    ) -> dict[str, Any]:
        """Soft-delete: the name is free again and chat with it is a 404 from now on."""
        row = await unregister(adapters, request.user.tenant_id, name)
        return {"name": row.name, "digest": row.digest, "deleted": True}


async def upload_adapter(
    request: Request, adapters: Adapters, config: GatewayConfig, tenant_id: str, replace: bool
) -> Adapter:
    """Read ``request``'s upload form and register the adapter for ``tenant_id``.

    The ``POST /v1/adapters`` route's work (see :class:`AdapterController`), shared with the
    console's upload (``gateway.console.adapters``).

    Returns:
        The new adapter's row.

    Raises:
        APIError: 400 bad name, form, archive or adapter (the validator's message); 409 name
            taken; 413 body over the upload limit.
    """
    limits, spool = upload_limits(adapters.engine, config), spool_dir(config)
    form = await read_form(request, limits, spool)
    try:
        name = check_name(form.name)
        if name == adapters.engine.model_name:
            raise APIError(
                409, f"{name!r} is the served base model's name", param="name", code="conflict"
            )
        if not replace:
            await ensure_name_free(adapters, tenant_id, name)
        part = check_shape(form)
        async with adapters.registry.uploads:  # waiting holds only the spool files
            config_bytes, weights_bytes = await asyncio.to_thread(
                adapter_bytes, form, part, limits, spool
            )
            form.close()
            try:
                return await register(
                    adapters, tenant_id, name, config_bytes, weights_bytes, replace=replace
                )
            except AdapterError as exc:
                raise APIError(400, str(exc), param=part, code="invalid_adapter") from None
            finally:
                del config_bytes, weights_bytes
    finally:
        form.close()


def adapter_controller(engine: EngineClient, config: GatewayConfig) -> type[AdapterController]:
    """:class:`AdapterController` with the upload body limit of ``engine``'s model and ``config``.

    The limit is fixed per app, when its routes are registered, so it is a class attribute of
    a subclass made here rather than something a request could be handed.
    """
    limit = upload_limits(engine, config).body_bytes
    return type("AdapterController", (AdapterController,), {"request_max_body_size": limit})
