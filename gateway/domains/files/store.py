"""Files of ``/v1/files``: their rows (``StoredFile``), their bytes in the data directory.

A file's bytes are ``DATA/files/<file id>`` (mode 0600 in a 0700 directory), written whole to a
temporary name first and renamed, so a crash never leaves half a file under an id. Its row holds
the tenant, ``purpose``, name, size and line count. Every lookup is by tenant and id: another
tenant's id is "not found", exactly as an id that never existed (CONTRACT.md, 404).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.gateway.db.models import StoredFile
from loraplex.gateway.db.types import utcnow
from loraplex.gateway.errors import not_found
from loraplex.gateway.settings import private_dir

FILE_PREFIX = "file-"


def new_file_id() -> str:
    """A fresh file id, OpenAI's shape: ``file-`` and 32 hex digits (128 random bits)."""
    return FILE_PREFIX + secrets.token_hex(16)


def file_path(files_dir: Path, file_id: str) -> Path:
    """Where the bytes of ``file_id`` live (the id is ours: ``file-`` and hex, never a path)."""
    return Path(files_dir) / file_id


def files_root(files_dir: Path) -> Path:
    """The files directory, made 0700 if missing."""
    return private_dir(files_dir)


def file_view(row: StoredFile) -> dict[str, Any]:
    """OpenAI's File object for a row (``openai.types.FileObject``)."""
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": int(row.created_at.timestamp()),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


async def get_file(session: AsyncSession, tenant_id: str, file_id: str) -> StoredFile:
    """The tenant's file ``file_id``.

    Raises:
        APIError: 404 ``file_not_found`` when absent or another tenant's (the same answer).
    """
    row = await session.get(StoredFile, file_id[:64]) if len(file_id) <= 64 else None
    if row is None or row.tenant_id != tenant_id:
        raise not_found(f"no file with id {file_id[:64]!r}", code="file_not_found")
    return row


async def count_files(session: AsyncSession, tenant_id: str) -> int:
    """How many files the tenant holds (uploads and batch outputs)."""
    query = select(func.count()).select_from(StoredFile).where(StoredFile.tenant_id == tenant_id)
    return int(await session.scalar(query) or 0)


async def list_files(
    session: AsyncSession,
    tenant_id: str,
    purpose: str | None,
    limit: int,
    after: str | None,
    ascending: bool,
) -> tuple[list[StoredFile], bool]:
    """A page of the tenant's files, by creation time (then id).

    Args:
        session: The session.
        tenant_id: Whose files.
        purpose: Only files of this purpose (None: all).
        limit: Page size (the caller bounds it).
        after: The cursor: the page starts after this file id (the tenant's own; else 404).
        ascending: Oldest first (``order=asc``), else newest first.

    Returns:
        The page and whether more follow.
    """
    order = (
        (StoredFile.created_at.asc(), StoredFile.id.asc())
        if ascending
        else (StoredFile.created_at.desc(), StoredFile.id.desc())
    )
    query = select(StoredFile).where(StoredFile.tenant_id == tenant_id)
    if purpose is not None:
        query = query.where(StoredFile.purpose == purpose)
    if after is not None:
        cursor = await get_file(session, tenant_id, after)
        key = (StoredFile.created_at, StoredFile.id)
        if ascending:
            query = query.where(
                (key[0] > cursor.created_at)
                | ((key[0] == cursor.created_at) & (key[1] > cursor.id))
            )
        else:
            query = query.where(
                (key[0] < cursor.created_at)
                | ((key[0] == cursor.created_at) & (key[1] < cursor.id))
            )
    rows = list((await session.scalars(query.order_by(*order).limit(limit + 1))).all())
    return rows[:limit], len(rows) > limit


async def add_file(
    session: AsyncSession,
    files_dir: Path,
    *,
    tenant_id: str,
    purpose: str,
    filename: str,
    temp: Path,
    size: int,
    lines: int,
    file_id: str | None = None,
) -> StoredFile:
    """Move ``temp`` under a new id and record it (committed); the bytes go if the row fails.

    Returns:
        The new row.
    """
    file_id = file_id or new_file_id()
    target = file_path(files_dir, file_id)
    os.replace(temp, target)
    row = StoredFile(
        id=file_id,
        tenant_id=tenant_id,
        purpose=purpose,
        filename=filename[:256],
        bytes=size,
        lines=lines,
        created_at=utcnow(),
    )
    try:
        session.add(row)
        await session.commit()
    except BaseException:
        with contextlib.suppress(OSError):
            target.unlink()
        raise
    return row


async def delete_file(session: AsyncSession, files_dir: Path, row: StoredFile) -> None:
    """Delete a file's row (committed), then its bytes."""
    await session.delete(row)
    await session.commit()
    with contextlib.suppress(FileNotFoundError):
        file_path(files_dir, row.id).unlink()
