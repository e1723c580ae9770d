"""``GET /v1/models``: the served base model and the calling tenant's adapters (OpenAI shape)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, get
from litestar.params import FromPath
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.gateway.di import Injected
from loraplex.gateway.domains.adapters.views import adapter_model_card, base_model_card, list_body
from loraplex.gateway.errors import not_found
from loraplex.gateway.server.engine_client import EngineClient
from loraplex.gateway.services.adapters import find_adapter, list_adapters


class ModelsController(Controller):
    """What a tenant may put in ``model``: the base model's name or one of its adapters."""

    path = "/v1/models"

    @get("/")
    async def list_models(
        self,
        request: Request,
        engine: Injected[EngineClient],
        sessions: Injected[async_sessionmaker],
    ) -> dict[str, Any]:
        """The base model first (with what its adapters may target), then the tenant's adapters."""
        principal = request.user
        async with sessions() as session:
            rows = await list_adapters(session, principal.tenant_id)
        base = engine.model_name
        cards = [adapter_model_card(r, principal.tenant_name, base) for r in rows]
        return list_body([base_model_card(base, engine.adapter_limits), *cards])

    @get("/{model:path}")
    async def get_model(
        self,
        request: Request,
        engine: Injected[EngineClient],
        sessions: Injected[async_sessionmaker],
        model: FromPath[str],
    ) -> dict[str, Any]:
        """One model by id (404 ``model_not_found`` for unknown or another tenant's adapter)."""
        principal = request.user
        model = model.lstrip("/")
        base = engine.model_name
        if model == base:
            return base_model_card(base, engine.adapter_limits)
        async with sessions() as session:
            row = await find_adapter(session, principal.tenant_id, model)
        if row is None:
            raise not_found(f"the model {model!r} does not exist", code="model_not_found")
        return adapter_model_card(row, principal.tenant_name, base)
