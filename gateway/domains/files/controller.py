"""``/v1/files``: a tenant's files, as OpenAI's Files API defines them (docs/api.md, Batch API).

Upload (``purpose: batch`` only: the input of ``/v1/batches``), list, retrieve, download and
delete. A batch's output and error files appear here too, with ``purpose: batch_output``.
Every route sees only the calling tenant's files: another tenant's id is a 404, exactly like
an id that never existed. An upload is bounded while it streams: ``batch_file_max_bytes``
(413 beyond), ``batch_max_requests`` lines (400), UTF-8 text (400); its lines are checked as
batch requests when a batch is created from it (OpenAI's order: a bad line fails the batch,
with the line in its ``errors``).
"""

from __future__ import annotations

import asyncio
import codecs
from pathlib import Path
from typing import Any

from litestar import Controller, Request, Response, delete, get, post
from litestar.params import FromPath, FromQuery
from litestar.response import File
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.gateway.di import Injected
from loraplex.gateway.domains.files.store import (
    add_file,
    count_files,
    delete_file,
    file_path,
    file_view,
    files_root,
    get_file,
    list_files,
)
from loraplex.gateway.domains.files.upload import read_file_form
from loraplex.gateway.errors import APIError, bad_request
from loraplex.gateway.server.config import GatewayConfig

UPLOAD_PURPOSES = ("batch",)
LIST_PURPOSES = ("batch", "batch_output")
MAX_PAGE = 10_000
FORM_OVERHEAD = 64 * 1024
"""Bytes of multipart framing and the ``purpose`` field allowed on top of the file."""


def list_page(rows: list[Any], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: ``{object: list, data, first_id, last_id, has_more}``."""
    return {
        "object": "list",
        "data": rows,
        "first_id": rows[0]["id"] if rows else None,
        "last_id": rows[-1]["id"] if rows else None,
        "has_more": has_more,
    }


def check_limit(limit: int, most: int) -> int:
    """``limit`` within ``[1, most]``.

    Raises:
        APIError: 400 naming ``limit`` otherwise.
    """
    if not 1 <= limit <= most:
        raise bad_request(f"'limit' must be between 1 and {most}", param="limit")
    return limit


class FilesController(Controller):
    """Upload, list, retrieve, download and delete the calling tenant's files.

    Registered through :func:`files_controller`, which sets the upload route's body limit.
    """

    path = "/v1/files"

    @post("/", status_code=200)
    async def upload(
        self,
        request: Request,
        sessions: Injected[async_sessionmaker],
        config: Injected[GatewayConfig],
    ) -> dict[str, Any]:
        """Multipart ``file`` + ``purpose: batch`` -> the File object.

        Raises:
            APIError: 400 a purpose other than ``batch``, no file, an empty file, a file that
                is not UTF-8 or has too many lines, an unknown field; 413 over the size limit;
                429 ``too_many_files`` when the tenant holds ``batch_max_files_per_tenant``.
        """
        root = files_root(config.files_dir)
        async with sessions() as session:
            held = await count_files(session, request.user.tenant_id)
        if held >= config.batch_max_files_per_tenant:
            raise APIError(
                429,
                f"this tenant holds {held} files, the most allowed: delete some first",
                code="too_many_files",
            )
        form = await read_file_form(
            request, root, config.batch_file_max_bytes, config.batch_max_requests
        )
        try:
            if form.purpose is None:
                raise bad_request("'purpose' is required", param="purpose")
            if form.purpose not in UPLOAD_PURPOSES:
                raise bad_request(
                    f"'purpose' must be one of {list(UPLOAD_PURPOSES)} (this server only has "
                    f"the Batch API), not {form.purpose[:64]!r}",
                    param="purpose",
                )
            if form.temp is None:
                raise bad_request("a 'file' part is required", param="file")
            if form.lines == 0:
                raise bad_request("the file is empty: it must hold JSONL requests", param="file")
            if not await asyncio.to_thread(_is_utf8, form.temp):
                raise bad_request("the file is not UTF-8 text (JSONL)", param="file")
            async with sessions() as session:
                row = await add_file(
                    session,
                    root,
                    tenant_id=request.user.tenant_id,
                    purpose=form.purpose,
                    filename=form.filename,
                    temp=form.temp,
                    size=form.size,
                    lines=form.lines,
                )
        finally:
            form.close()
        return file_view(row)

    @get("/")
    async def list_files(
        self,
        request: Request,
        sessions: Injected[async_sessionmaker],
        purpose: FromQuery[str | None] = None,
        limit: FromQuery[int] = MAX_PAGE,
        after: FromQuery[str | None] = None,
        order: FromQuery[str] = "desc",
    ) -> dict[str, Any]:
        """The tenant's files, newest first (``order=asc``: oldest), a page at a time."""
        if purpose is not None and purpose not in LIST_PURPOSES:
            raise bad_request(f"'purpose' must be one of {list(LIST_PURPOSES)}", param="purpose")
        if order not in ("asc", "desc"):
            raise bad_request("'order' must be 'asc' or 'desc'", param="order")
        check_limit(limit, MAX_PAGE)
        async with sessions() as session:
            rows, more = await list_files(
                session, request.user.tenant_id, purpose, limit, after, order == "asc"
            )
        return list_page([file_view(row) for row in rows], more)

    @get("/{file_id:str}")
    async def retrieve(
        self, request: Request, sessions: Injected[async_sessionmaker], file_id: FromPath[str]
    ) -> dict[str, Any]:
        """One of the tenant's files (404 if absent or another tenant's)."""
        async with sessions() as session:
            return file_view(await get_file(session, request.user.tenant_id, file_id))

    @get("/{file_id:str}/content", media_type="application/octet-stream")
    async def content(
        self,
        request: Request,
        sessions: Injected[async_sessionmaker],
        config: Injected[GatewayConfig],
        file_id: FromPath[str],
    ) -> File:
        """The file's bytes, streamed from disk (404 if absent or another tenant's)."""
        async with sessions() as session:
            row = await get_file(session, request.user.tenant_id, file_id)
        return File(
            path=file_path(config.files_dir, row.id),
            filename=row.filename,
            media_type="application/octet-stream",
            content_disposition_type="attachment",
        )

    @delete("/{file_id:str}", status_code=200)
    async def delete(
        self,
        request: Request,
        sessions: Injected[async_sessionmaker],
        config: Injected[GatewayConfig],
        file_id: FromPath[str],
    ) -> Response:
        """Delete the file (row and bytes): ``{id, object: file, deleted: true}``."""
        async with sessions() as session:
            row = await get_file(session, request.user.tenant_id, file_id)
            await delete_file(session, config.files_dir, row)
        return Response({"id": row.id, "object": "file", "deleted": True})


def files_controller(config: GatewayConfig) -> type[FilesController]:
    """:class:`FilesController` whose body limit is ``batch_file_max_bytes`` plus framing."""
    limit = config.batch_file_max_bytes + FORM_OVERHEAD
    return type("FilesController", (FilesController,), {"request_max_body_size": limit})


def _is_utf8(path: Path) -> bool:
    """Whether the file decodes as UTF-8 (read in 1 MiB chunks)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True
