"""``GET /v1/usage``: the calling tenant's usage, totals and per model (docs/usage.md)."""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.params import FromQuery
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.gateway.auth.principals import TenantPrincipal
from loraplex.gateway.di import Injected
from loraplex.gateway.errors import bad_request
from loraplex.gateway.services.errors import InvalidInputError
from loraplex.gateway.usage.records import parse_time, usage_summary
from loraplex.gateway.usage.writer import UsageWriter

FLUSH_TIMEOUT_S = 10.0


@get("/v1/usage")
async def get_usage(
    request: Request,
    usage: Injected[UsageWriter],
    sessions: Injected[async_sessionmaker],
    since: FromQuery[str | None] = None,
    until: FromQuery[str | None] = None,
) -> dict[str, Any]:
    """``{"object": "usage", "tenant", "totals", "by_model"}`` over ``[since, until)``.

    Usage not yet in the database is written first, so a request's usage shows as soon as its
    response has been read. Only the caller's tenant's rows are ever read.

    Raises:
        APIError: 400 when ``since`` or ``until`` is not ISO 8601; 503 + ``Retry-After`` when
            the usage database is unreachable or the rows before this call are not written
            within ``FLUSH_TIMEOUT_S`` (the totals would be incomplete).
    """
    principal: TenantPrincipal = request.user
    bounds = {}
    for name, value in (("since", since), ("until", until)):
        try:
            bounds[name] = parse_time(value)
        except InvalidInputError as exc:
            raise bad_request(f"'{name}': {exc}", param=name) from None
    await usage.flush(timeout=FLUSH_TIMEOUT_S)
    async with sessions() as session:
        return await usage_summary(session, principal.tenant_id, **bounds)
