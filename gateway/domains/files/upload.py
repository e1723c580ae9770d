"""The ``POST /v1/files`` multipart body, parsed as it streams, the file spooled to disk.

Two parts, as OpenAI's ``client.files.create(file=..., purpose=...)`` sends them: ``purpose``
(a text field) and ``file`` (a file part). The file streams into a temporary file in the files
directory, refused with 413 past ``batch_file_max_bytes`` while it streams, and its lines are
counted on the way (refused with 400 past ``batch_max_requests``); nothing but a 64 KiB write
buffer is held in memory. Any other field is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from litestar import Request
from multipart import MultipartSegment, ParserError, ParserLimitReached, PushMultipartParser

from loraplex.gateway.errors import APIError, bad_request

TEXT_FIELD_BYTES = 256
MAX_PARTS = 4
WRITE_BYTES = 64 * 1024
FIELDS = ("file", "purpose")


@dataclass
class FileForm:
    """The parsed form; :meth:`close` removes the spooled file unless it was kept.

    Attributes:
        purpose: The ``purpose`` field (None if absent).
        filename: The file part's name, directories dropped.
        temp: The spooled file (None if no file part came).
        size: Its bytes.
        lines: Its non-blank lines.
        last_byte: Its last byte (a final line without a newline still counts).
    """

    purpose: str | None = None
    filename: str = ""
    temp: Path | None = None
    size: int = 0
    lines: int = 0
    last_byte: bytes = b""
    _text: dict[str, bytearray] = field(default_factory=dict)

    def close(self) -> None:
        """Remove the spooled file (if still there)."""
        if self.temp is not None:
            with contextlib.suppress(FileNotFoundError):
                self.temp.unlink()


async def read_file_form(
    request: Request, files_dir: Path, max_bytes: int, max_lines: int
) -> FileForm:
    """Stream the form into a :class:`FileForm` (the caller closes it).

    Args:
        request: The upload.
        files_dir: Where the file part is spooled (then renamed to its id by the caller).
        max_bytes: Largest file part; 413 beyond.
        max_lines: Most lines; 400 naming ``file`` beyond.

    Raises:
        APIError: 400 not multipart, malformed, an unknown or repeated field, a text field too
            long or not UTF-8, too many lines; 413 the file too large.
    """
    content_type, options = request.content_type
    if content_type != "multipart/form-data" or not options.get("boundary"):
        raise bad_request("the body must be multipart/form-data with 'file' and 'purpose' parts")
    form = FileForm()
    handle = None
    segment: MultipartSegment | None = None
    buffer = bytearray()
    newline_state = {"blank": True}
    try:
        with PushMultipartParser(options["boundary"], max_segment_count=MAX_PARTS) as parser:
            async for chunk in _chunks(request):
                for event in parser.parse(chunk):
                    if isinstance(event, MultipartSegment):
                        segment = event
                        handle = _open_part(event, form, files_dir)
                    elif event is not None and segment is not None:
                        if segment.name == "file":
                            form.size += len(event)
                            if form.size > max_bytes:
                                raise APIError(
                                    413,
                                    f"the file is larger than {max_bytes} bytes",
                                    param="file",
                                    code="file_too_large",
                                )
                            form.lines += _count_lines(bytes(event), newline_state)
                            if form.lines > max_lines:
                                raise bad_request(
                                    f"the file has more than {max_lines} lines (requests)",
                                    param="file",
                                )
                            buffer += event
                            if len(buffer) >= WRITE_BYTES:
                                data, buffer = bytes(buffer), bytearray()
                                await asyncio.to_thread(handle.write, data)
                        else:
                            text = form._text[segment.name]
                            text += event
                            if len(text) > TEXT_FIELD_BYTES:
                                raise bad_request(
                                    f"'{segment.name}' is too long", param=segment.name
                                )
                    elif segment is not None:  # the part ended
                        if segment.name == "file":
                            if buffer:
                                await asyncio.to_thread(handle.write, bytes(buffer))
                                buffer = bytearray()
                            handle.close()
                            handle = None
                        segment = None
    except BaseException as exc:
        if handle is not None:
            handle.close()
        form.close()
        if isinstance(exc, ParserLimitReached):
            raise bad_request(f"the form has more than {MAX_PARTS} parts") from None
        if isinstance(exc, ParserError):
            raise bad_request(f"the body is not valid multipart/form-data ({exc})") from None
        raise
    if not newline_state["blank"]:
        form.lines += 1  # a last line without a newline
        if form.lines > max_lines:
            form.close()
            raise bad_request(f"the file has more than {max_lines} lines (requests)", param="file")
    raw = form._text.get("purpose")
    if raw is not None:
        try:
            form.purpose = raw.decode("utf-8")
        except UnicodeDecodeError:
            form.close()
            raise bad_request("'purpose' is not UTF-8", param="purpose") from None
    return form


def _open_part(segment: MultipartSegment, form: FileForm, files_dir: Path):
    """Check a part's header; open the spool file for ``file``."""
    name = segment.name or ""
    if name not in FIELDS:
        raise bad_request(
            f"unknown field {name[:64]!r}: this endpoint takes 'file' and 'purpose'",
            param=name[:64] or None,
        )
    if name in form._text or (name == "file" and form.temp is not None):
        raise bad_request(f"'{name}' was sent twice", param=name)
    if name == "purpose":
        if segment.filename:
            raise bad_request("'purpose' must be a text field", param="purpose")
        form._text[name] = bytearray()
        return None
    if not segment.filename:
        raise bad_request("the 'file' part must be a file (with a file name)", param="file")
    form.filename = segment.filename.replace("\\", "/").rsplit("/", 1)[-1][:256]
    handle = tempfile.NamedTemporaryFile(dir=files_dir, prefix=".upload-", delete=False)  # noqa: SIM115
    form.temp = Path(handle.name)
    return handle


def _count_lines(data: bytes, state: dict[str, bool]) -> int:
    """Non-blank lines completed in ``data`` (``state["blank"]``: the open line is blank)."""
    count = 0
    start = 0
    blank = state["blank"]
    while True:
        end = data.find(b"\n", start)
        piece = data[start:] if end < 0 else data[start:end]
        if piece.strip():
            blank = False
        if end < 0:
            break
        if not blank:
            count += 1
        blank = True
        start = end + 1
    state["blank"] = blank
    return count


async def _chunks(request: Request):
    async for chunk in request.stream():
        yield chunk
    yield b""
