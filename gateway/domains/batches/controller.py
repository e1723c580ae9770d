"""``/v1/batches``: OpenAI's Batch API over the tenant's files (docs/api.md, Batch API).

Create (``input_file_id``, ``endpoint``, ``completion_window: "24h"``, ``metadata``), retrieve,
list (newest first, ``after`` / ``limit``) and cancel. The batch runs in the gateway
(``gateway.domains.batches.runner``); its status, counts and output files are its row.
Every route sees only the calling tenant's batches and files: another tenant's id is a 404.
"""

from __future__ import annotations

import secrets
from typing import Any

from litestar import Controller, Request, get, post
from litestar.params import FromPath, FromQuery
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.gateway.db.models import Batch
from loraplex.gateway.db.types import utcnow
from loraplex.gateway.di import Injected
from loraplex.gateway.domains.batches.runner import ACTIVE, BatchRunner, expires_at_for
from loraplex.gateway.domains.chat.controller import BATCH_ENDPOINTS
from loraplex.gateway.domains.files.controller import check_limit, list_page
from loraplex.gateway.domains.files.store import get_file
from loraplex.gateway.errors import APIError, bad_request, not_found
from loraplex.gateway.server.config import GatewayConfig
from loraplex.gateway.transport.json_body import decode_object

CREATE_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata")
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_PAGE = 100
_TIMES = (
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def batch_view(row: Batch) -> dict[str, Any]:
    """OpenAI's Batch object for a row (``openai.types.Batch``)."""
    body: dict[str, Any] = {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": None if not row.errors else {"object": "list", "data": row.errors},
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": int(row.created_at.timestamp()),
        "request_counts": {"total": row.total, "completed": row.completed, "failed": row.failed},
        "metadata": row.batch_metadata,
    }
    for name in _TIMES:
        value = getattr(row, name)
        body[name] = None if value is None else int(value.timestamp())
    return body


def check_metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's ``metadata``: at most 16 string pairs, keys <= 64 and values <= 512 characters.

    Raises:
        APIError: 400 naming ``metadata`` otherwise.
    """
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise bad_request(
            f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} pairs",
            param="metadata",
        )
    for key, item in value.items():
        if (
            len(key) > MAX_METADATA_KEY
            or not isinstance(item, str)
            or len(item) > MAX_METADATA_VALUE
        ):
            raise bad_request(
                f"'metadata' keys are at most {MAX_METADATA_KEY} characters and values strings "
                f"of at most {MAX_METADATA_VALUE}",
                param="metadata",
            )
    return value


async def get_batch(session: AsyncSession, tenant_id: str, batch_id: str) -> Batch:
    """The tenant's batch.

    Raises:
        APIError: 404 when absent or another tenant's (the same answer).
    """
    row = await session.get(Batch, batch_id) if len(batch_id) <= 64 else None
    if row is None or row.tenant_id != tenant_id:
        raise not_found(f"no batch with id {batch_id[:64]!r}", code="batch_not_found")
    return row


class BatchesController(Controller):
    """Create, retrieve, list and cancel the calling tenant's batches."""

    path = "/v1/batches"

    @post("/", status_code=200)
    async def create(
        self,
        request: Request,
        sessions: Injected[async_sessionmaker],
        batch_runner: Injected[BatchRunner],
        config: Injected[GatewayConfig],
    ) -> dict[str, Any]:
        """Create a batch from an uploaded ``purpose: batch`` file; it starts ``validating``.

        Raises:
            APIError: 400 an unknown field, an endpoint other than ``/v1/chat/completions`` and
                ``/v1/completions``, a window other than ``24h``, bad ``metadata``, a file not
                of purpose ``batch``; 404 the file absent or another tenant's; 429
                ``too_many_batches`` past ``batch_max_active_per_tenant`` unfinished ones.
        """
        data = decode_object(await request.body())
        for key in data:
            if key not in CREATE_FIELDS:
                raise bad_request(f"unknown field {key[:64]!r}", param=key[:64])
        file_id = data.get("input_file_id")
        if not isinstance(file_id, str):
            raise bad_request("'input_file_id' is required", param="input_file_id")
        endpoint = data.get("endpoint")
        if endpoint not in BATCH_ENDPOINTS:
            raise bad_request(
                f"'endpoint' must be one of {list(BATCH_ENDPOINTS)}", param="endpoint"
            )
        if data.get("completion_window") != "24h":
            raise bad_request("'completion_window' must be '24h'", param="completion_window")
        metadata = check_metadata(data.get("metadata"))
        principal = request.user
        async with sessions() as session:
            file = await get_file(session, principal.tenant_id, file_id)
            active = await session.scalar(
                select(func.count())
                .select_from(Batch)
                .where(Batch.tenant_id == principal.tenant_id, Batch.status.in_(ACTIVE))
            )
            if active >= config.batch_max_active_per_tenant:
                raise APIError(
                    429,
                    f"this tenant has {active} unfinished batches, the most allowed",
                    code="too_many_batches",
                )
            if file.purpose != "batch":
                raise bad_request(
                    f"the file's purpose is {file.purpose!r}, not 'batch'", param="input_file_id"
                )
            now = utcnow()
            row = Batch(
                id=f"batch_{secrets.token_hex(16)}",
                tenant_id=principal.tenant_id,
                key_id=principal.key_id,
                endpoint=endpoint,
                input_file_id=file.id,
                completion_window="24h",
                status="validating",
                batch_metadata=metadata,
                total=file.lines,
                completed=0,
                failed=0,
                created_at=now,
                expires_at=expires_at_for(now),
            )
            session.add(row)
            await session.commit()
            view = batch_view(row)
        batch_runner.launch(row.id)
        return view

    @get("/")
    async def list_batches(
        self,
        request: Request,
        sessions: Injected[async_sessionmaker],
        limit: FromQuery[int] = 20,
        after: FromQuery[str | None] = None,
    ) -> dict[str, Any]:
        """The tenant's batches, newest first, ``limit`` (1 to 100) after the ``after`` id."""
        check_limit(limit, MAX_PAGE)
        tenant = request.user.tenant_id
        async with sessions() as session:
            query = select(Batch).where(Batch.tenant_id == tenant)
            if after is not None:
                cursor = await get_batch(session, tenant, after)
                query = query.where(
                    (Batch.created_at < cursor.created_at)
                    | ((Batch.created_at == cursor.created_at) & (Batch.id < cursor.id))
                )
            query = query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)
            rows = list((await session.scalars(query)).all())
        return list_page([batch_view(row) for row in rows[:limit]], len(rows) > limit)

    @get("/{batch_id:str}")
    async def retrieve(
        self, request: Request, sessions: Injected[async_sessionmaker], batch_id: FromPath[str]
    ) -> dict[str, Any]:
        """One of the tenant's batches (404 if absent or another tenant's)."""
        async with sessions() as session:
            return batch_view(await get_batch(session, request.user.tenant_id, batch_id))

    @post("/{batch_id:str}/cancel", status_code=200)
    async def cancel(
        self,
        request: Request,
        sessions: Injected[async_sessionmaker],
        batch_runner: Injected[BatchRunner],
        batch_id: FromPath[str],
    ) -> dict[str, Any]:
        """Cancel: ``cancelling`` now, ``cancelled`` once the lines in flight are aborted.

        Raises:
            APIError: 400 when the batch has already ended (or is finalizing); 404 absent.
        """
        async with sessions() as session:
            row = await get_batch(session, request.user.tenant_id, batch_id)
            if row.status not in ("validating", "in_progress", "cancelling"):
                raise bad_request(f"a batch with status {row.status!r} cannot be cancelled")
            if row.status != "cancelling":
                row.status = "cancelling"
                row.cancelling_at = utcnow()
                await session.commit()
            view = batch_view(row)
        batch_runner.cancel(row.id)
        batch_runner.launch(row.id)  # finalizes it if no task of this gateway runs it
        return view
