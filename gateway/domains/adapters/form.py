"""The ``POST /v1/adapters`` multipart body, parsed as it streams, every part bounded.

Litestar's own ``request.form()`` keeps text parts whole in memory and file parts in memory up
to 1 MiB each before they roll to disk, with up to 1,000 parts: a 512 MiB body of small parts
was held in memory. Here the body streams through ``multipart.PushMultipartParser`` (the
library Litestar uses) and each part is handled as its header arrives:

- ``name`` (and any other text field) is kept in memory up to :data:`TEXT_FIELD_BYTES`;
- ``files`` parts named ``adapter_config.json`` / ``adapter_model.safetensors`` and the
  ``archive`` part are spooled to anonymous temporary files on disk, each refused (400) past
  its :class:`gateway.domains.adapters.limits.UploadLimits` cap while it streams;
- other file parts are read and dropped (the body limit bounds them);
- at most :data:`MAX_PARTS` parts; a ``files`` or ``archive`` part without a file name, a second
  copy of either file, or a second archive is refused as soon as its header arrives.

Memory per upload stays under :data:`WRITE_BYTES` per spooled part plus the parser's chunk, so a
parsed upload waiting for a processing slot holds only its spool files.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from litestar import Request
from multipart import MultipartSegment, ParserError, ParserLimitReached, PushMultipartParser

from loraplex.adapters.validation import CONFIG_NAME, WEIGHTS_NAME
from loraplex.gateway.domains.adapters.limits import UploadLimits
from loraplex.gateway.errors import APIError, bad_request

TEXT_FIELD_BYTES = 4096
"""Largest text field (``name`` is at most 64 characters)."""
MAX_PARTS = 16
"""Most parts in one form."""
WRITE_BYTES = 1 << 20
"""Bytes buffered per spooled part before a write to disk."""


@dataclass
class FilePart:
    """One file part of the form.

    Attributes:
        field: The form field (``files`` or ``archive``).
        filename: The client's file name with any directory dropped.
        file: The spooled bytes (None for a part that was read and dropped).
        size: Bytes received.
    """

    field: str
    filename: str
    file: BinaryIO | None = None
    size: int = 0

    def read(self) -> bytes:
        """The whole part, read once into one buffer (blocking: call from a worker thread)."""
        assert self.file is not None
        self.file.seek(0)
        return self.file.read()


@dataclass
class UploadForm:
    """The parsed form (:meth:`close` it: its files sit on disk).

    Attributes:
        name: The ``name`` field: a string, a :class:`FilePart` if sent as a file, or None.
        files: The two adapter files sent as ``files`` parts, by base name.
        other_files: Base names of the other ``files`` parts (dropped).
        archives: The ``archive`` parts.
    """

    name: object = None
    files: dict[str, FilePart] = field(default_factory=dict)
    other_files: list[str] = field(default_factory=list)
    archives: list[FilePart] = field(default_factory=list)

    def close(self) -> None:
        """Delete the spool files."""
        for part in [*self.files.values(), *self.archives]:
            if part.file is not None:
                part.file.close()
                part.file = None


class _Sink:
    """Where one part's bytes go: memory (text), a spool file or nowhere, with a cap."""

    def __init__(self, cap: float, file: BinaryIO | None, keep_text: bool = False) -> None:
        self.cap = cap
        self.file = file
        self.keep_text = keep_text
        self.buffer = bytearray()
        self.size = 0

    async def write(self, data: Any) -> bool:
        """Take a chunk; False once past the cap (nothing more is kept)."""
        self.size += len(data)
        if self.size > self.cap:
            return False
        if self.file is not None or self.keep_text:
            self.buffer += data
        if self.file is not None and len(self.buffer) >= WRITE_BYTES:
            await self.flush()
        return True

    async def flush(self) -> None:
        if self.file is not None and self.buffer:
            data, self.buffer = bytes(self.buffer), bytearray()
            await asyncio.to_thread(self.file.write, data)


async def read_form(
    request: Request, limits: UploadLimits, spool_dir: str | os.PathLike[str]
) -> UploadForm:
    """Parse the multipart body as it streams (see the module docstring).

    Args:
        request: The upload request (the route's body limit applies while it streams).
        limits: The caps of the two files and the archive.
        spool_dir: Where file parts are spooled (anonymous files, gone when closed).

    Returns:
        The form; the caller closes it.

    Raises:
        APIError: 400 for a body that is not ``multipart/form-data``, a malformed body, too many
            parts, a text field that is not UTF-8 or too long, a file part over its cap, or the
            form-shape refusals above; 413 past the body limit (Litestar's own).
    """
    content_type, options = request.content_type
    if content_type != "multipart/form-data" or not options.get("boundary"):
        raise bad_request(
            "the body must be multipart/form-data with 'name' and 'files' or 'archive' parts"
        )
    form = UploadForm()
    current: tuple[MultipartSegment, _Sink] | None = None
    try:
        with PushMultipartParser(options["boundary"], max_segment_count=MAX_PARTS) as parser:
            async for chunk in _chunks(request):
                for event in parser.parse(chunk):
                    if isinstance(event, MultipartSegment):
                        current = (event, _open(event, form, limits, spool_dir))
                    elif event is not None and current is not None:
                        if not await current[1].write(event):
                            raise _too_large(current[0], current[1].cap)
                    elif current is not None:
                        await _finish(*current, form)
                        current = None
    except BaseException as exc:
        form.close()
        if current is not None and current[1].file is not None:
            current[1].file.close()
        if isinstance(exc, ParserLimitReached):
            raise bad_request(
                f"the form has more than {MAX_PARTS} parts or a part header too large"
            ) from None
        if isinstance(exc, ParserError):
            raise bad_request(f"the body is not valid multipart/form-data ({exc})") from None
        raise
    return form


async def _chunks(request: Request):
    """The body's chunks, then an empty one (end of input for the parser)."""
    async for chunk in request.stream():
        yield chunk
    yield b""


def _base(filename: str) -> str:
    return filename.replace("\\", "/").rsplit("/", 1)[-1]


def _open(
    segment: MultipartSegment, form: UploadForm, limits: UploadLimits, spool_dir: Any
) -> _Sink:
    """Decide where a part goes from its header alone."""
    key, filename = segment.name or "", segment.filename
    if key in ("files", "archive") and not filename:
        raise bad_request(f"the '{key}' part must be a file (with a file name)", param=key)
    if not filename:
        return _Sink(TEXT_FIELD_BYTES, None, keep_text=True)
    if key == "archive":
        if form.archives:
            raise bad_request("send one 'archive' part", param="archive")
        return _Sink(limits.body_bytes, tempfile.TemporaryFile(dir=spool_dir))
    if key == "files" and _base(filename) in (CONFIG_NAME, WEIGHTS_NAME):
        base = _base(filename)
        if base in form.files:
            raise bad_request(f"{base} was sent twice", param="files")
        cap = limits.config_bytes if base == CONFIG_NAME else limits.weights_bytes
        return _Sink(cap, tempfile.TemporaryFile(dir=spool_dir))
    return _Sink(float("inf"), None)  # another file: read and dropped


async def _finish(segment: MultipartSegment, sink: _Sink, form: UploadForm) -> None:
    """Record a complete part."""
    key, filename = segment.name or "", segment.filename
    if not filename:
        if key == "name":
            try:
                form.name = bytes(sink.buffer).decode(segment.charset or "utf-8")
            except (UnicodeDecodeError, LookupError):
                raise bad_request(
                    "a form field is not UTF-8 text: send each file part with a file name"
                ) from None
        return
    await sink.flush()
    part = FilePart(key, _base(filename), sink.file, sink.size)
    if key == "name":
        form.name = part
    elif key == "archive":
        form.archives.append(part)
    elif key == "files" and part.file is not None:
        form.files[part.filename] = part
    elif key == "files":
        form.other_files.append(part.filename)


def _too_large(segment: MultipartSegment, cap: float) -> APIError:
    key, filename = segment.name or "", segment.filename
    if not filename:
        return bad_request(f"the form field {key!r} is longer than {int(cap)} bytes", param=key)
    if key == "archive":
        return bad_request(
            f"the archive is larger than {int(cap)} bytes, more than a valid adapter for the "
            "served model needs",
            param="archive",
        )
    return APIError(
        400,
        f"{_base(filename)} is larger than {int(cap)} bytes, the most a valid one for the "
        "served model can weigh",
        param="files",
        code="invalid_adapter",
    )
