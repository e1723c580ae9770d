"""The ``POST /v1/adapters`` form: a name and the adapter's two files, loose or in one archive.

``multipart/form-data`` (CONTRACT.md) with ``name`` and either two ``files`` parts, told apart by
their file names (``adapter_config.json``, ``adapter_model.safetensors``; a client's directory
prefix is dropped), or one ``archive`` part (see :mod:`gateway.domains.adapters.archive`). Other
fields and other ``files`` parts are ignored, as the archive ignores other entries; weights
sent only as a pickle file are refused by name. Upload parts spool to disk past 1 MiB while the
body streams in; the archive is unpacked from there in a worker thread.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

from litestar import Request
from litestar.datastructures import UploadFile

from adapters.safetensors_io import PICKLE_SUFFIXES
from adapters.validation import CONFIG_NAME, WEIGHTS_NAME
from gateway.domains.adapters.archive import ArchiveError, unpack_adapter
from gateway.server.config import GatewayConfig
from gateway.server.errors import APIError, bad_request

NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass
class UploadForm:
    """The parsed form (close it when done: its files may sit on disk).

    Attributes:
        name: The ``name`` field as sent (not yet validated), or None.
        files: The ``files`` parts.
        archives: The ``archive`` parts.
        uploads: Every file part, to close.
    """

    name: object = None
    files: list[UploadFile] = field(default_factory=list)
    archives: list[UploadFile] = field(default_factory=list)
    uploads: list[UploadFile] = field(default_factory=list)

    async def close(self) -> None:
        """Release the spooled files."""
        for upload in self.uploads:
            await upload.close()


async def read_form(request: Request) -> UploadForm:
    """Parse the multipart body (the route's body limit applies while it streams).

    Raises:
        APIError: 400 when the body is not ``multipart/form-data`` or a text field is not UTF-8
            (a file part sent without a file name); 413 past the body limit (Litestar's own).
    """
    content_type, _ = request.content_type
    if content_type != "multipart/form-data":
        raise bad_request(
            "the body must be multipart/form-data with 'name' and 'files' or 'archive' parts"
        )
    try:
        multi = await request.form()
    except UnicodeDecodeError:
        raise bad_request(
            "a form field is not UTF-8 text: send each file part with a file name"
        ) from None
    form = UploadForm()
    for key, value in multi.multi_items():
        if isinstance(value, UploadFile):
            form.uploads.append(value)
        if key == "name":
            form.name = value
        elif key == "files" and isinstance(value, UploadFile):
            form.files.append(value)
        elif key == "archive" and isinstance(value, UploadFile):
            form.archives.append(value)
        elif key in ("files", "archive"):
            raise bad_request(f"the '{key}' part must be a file (with a file name)", param=key)
    return form


def check_name(value: object) -> str:
    """The adapter name, checked against ``^[A-Za-z0-9._-]{1,64}$``.

    Raises:
        APIError: 400 with param ``name``.
    """
    if value is None:
        raise bad_request("the 'name' field is required", param="name")
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise bad_request(
            "'name' must be 1 to 64 characters from A-Z, a-z, 0-9, '.', '_' and '-'",
            param="name",
        )
    return value


async def adapter_bytes(form: UploadForm, config: GatewayConfig) -> tuple[bytes, bytes, str]:
    """``(adapter_config.json, adapter_model.safetensors, the form part used)``.

    Raises:
        APIError: 400 for a form with neither or both kinds of parts, missing or duplicated
            files, pickle weights, or an archive refused by the archive policy.
    """
    if form.files and form.archives:
        raise bad_request("send either 'files' parts or one 'archive' part, not both")
    if len(form.archives) > 1:
        raise bad_request("send one 'archive' part", param="archive")
    if form.archives:
        archive = form.archives[0]
        try:
            config_bytes, weights_bytes = await asyncio.to_thread(
                unpack_adapter,
                archive.file,
                max_members=config.max_archive_members,
                max_unpacked_bytes=config.max_archive_unpacked_bytes,
            )
        except ArchiveError as exc:
            raise APIError(400, str(exc), param="archive", code="invalid_archive") from None
        return config_bytes, weights_bytes, "archive"
    if not form.files:
        raise bad_request(
            f"send the adapter as two 'files' parts ({CONFIG_NAME}, {WEIGHTS_NAME}) or one "
            "'archive' part (.zip or .tar.gz)",
            param="files",
        )
    by_name: dict[str, UploadFile] = {}
    for upload in form.files:
        base = upload.filename.replace("\\", "/").rsplit("/", 1)[-1]
        if base in by_name and base in (CONFIG_NAME, WEIGHTS_NAME):
            raise bad_request(f"{base} was sent twice", param="files")
        by_name.setdefault(base, upload)
    if WEIGHTS_NAME not in by_name:
        pickles = sorted(n for n in by_name if n.lower().endswith(PICKLE_SUFFIXES))
        if pickles:
            raise bad_request(
                f"adapter weights {pickles[0]} are a pickle file; only {WEIGHTS_NAME} is "
                "accepted (save with safe_serialization=True)",
                param="files",
                code="invalid_adapter",
            )
    for required in (CONFIG_NAME, WEIGHTS_NAME):
        if required not in by_name:
            raise bad_request(f"no 'files' part named {required}", param="files")
    return await by_name[CONFIG_NAME].read(), await by_name[WEIGHTS_NAME].read(), "files"
