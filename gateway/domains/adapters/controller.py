"""``/v1/adapters``: a tenant's LoRA adapters (upload, list, get, delete; CONTRACT.md).

Every route takes a tenant key (``gateway.server.auth``) and sees only that tenant's adapters:
another tenant's name is a 404, exactly like a name that does not exist. The upload route's body
limit is ``GatewayConfig.upload_max_body_bytes`` (the app's default is the smaller chat limit),
set on this controller when the app registers it; 413 beyond.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, Router, delete, get, post
from litestar.params import FromPath, FromQuery
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from adapters.errors import AdapterError
from gateway.domains.adapters.service import ensure_name_free, register, registry_of, unregister
from gateway.domains.adapters.upload import adapter_bytes, check_name, read_form
from gateway.domains.adapters.views import adapter_view, list_body
from gateway.server.errors import APIError
from gateway.services.adapters import get_adapter, list_adapters


class AdapterController(Controller):
    """Upload, list, get and delete the calling tenant's adapters."""

    path = "/v1/adapters"

    def __init__(self, owner: Router) -> None:
        super().__init__(owner)
        gateway = getattr(getattr(owner, "state", None), "gateway", None)
        if gateway is not None:  # registered on the app: uploads get their own body limit
            self.request_max_body_size = gateway.config.upload_max_body_bytes

    @post("/", status_code=HTTP_201_CREATED)
    async def upload(self, request: Request, replace: FromQuery[bool] = False) -> Response:
        """Multipart ``name`` + ``files`` (two) or ``archive`` (one) -> 201 the adapter.

        ``?replace=true`` replaces a live adapter of that name (the old row is soft-deleted and
        the new one recorded in one transaction); otherwise a taken name is a 409.

        Raises:
            APIError: 400 bad name, form, archive or adapter (the validator's message); 409
                name taken; 413 body over the upload limit.
        """
        state = request.app.state.gateway
        principal = request.user
        form = await read_form(request)
        try:
            name = check_name(form.name)
            if name == state.engine.model_name:
                raise APIError(
                    409, f"{name!r} is the served base model's name", param="name", code="conflict"
                )
            if not replace:
                await ensure_name_free(state, principal.tenant_id, name)
            config_bytes, weights_bytes, part = await adapter_bytes(form, state.config)
        finally:
            await form.close()
        try:
            row = await register(
                state,
                registry_of(request.app.state),
                principal.tenant_id,
                name,
                config_bytes,
                weights_bytes,
                replace=replace,
            )
        except AdapterError as exc:
            raise APIError(400, str(exc), param=part, code="invalid_adapter") from None
        return Response(adapter_view(row), status_code=HTTP_201_CREATED)

    @get("/")
    async def list_adapters(self, request: Request) -> dict[str, Any]:
        """The tenant's live adapters, by name, in OpenAI's list shape."""
        state = request.app.state.gateway
        async with state.sessions() as session:
            rows = await list_adapters(session, request.user.tenant_id)
        return list_body([adapter_view(row) for row in rows])

    @get("/{name:str}")
    async def get_adapter(self, request: Request, name: FromPath[str]) -> dict[str, Any]:
        """One adapter of the tenant (404 if absent or another tenant's)."""
        state = request.app.state.gateway
        async with state.sessions() as session:
            row = await get_adapter(session, request.user.tenant_id, name)
        return adapter_view(row)

    @delete("/{name:str}", status_code=HTTP_200_OK)
    async def delete_adapter(self, request: Request, name: FromPath[str]) -> dict[str, Any]:
        """Soft-delete: the name is free again and chat with it is a 404 from now on."""
        state = request.app.state.gateway
        row = await unregister(state, registry_of(request.app.state), request.user.tenant_id, name)
        return {"name": row.name, "digest": row.digest, "deleted": True}
