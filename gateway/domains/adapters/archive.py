r"""Unpack an uploaded adapter archive (.zip or .tar.gz) without trusting it.

The format is told by content, not by file name: ``PK\x03\x04`` (or an empty zip's
``PK\x05\x06``) is a zip, ``\x1f\x8b`` a gzip stream holding a tar; anything else is refused.

Policy (every refusal is an :class:`ArchiveError`, HTTP 400):

- At most ``max_members`` entries (directories count). For a zip the central directory's entry
  count and size are read from its end record *before* :mod:`zipfile` parses it, so a
  directory of millions of entries is never materialized; a tar is counted while it streams.
- At most ``max_unpacked_bytes`` decompressed in all, and each of the two files at most its own
  cap (``member_caps``: the gateway passes the most a valid ``adapter_config.json`` and
  ``adapter_model.safetensors`` for the served model can weigh, :mod:`adapters.sizes`), counted
  on the bytes actually produced while they are read, chunk by chunk (a zip entry's declared
  size is never trusted, and a tar's whole decompressed stream is capped too), so a zip bomb
  stops at the cap whatever its ratio. Between two tar members (headers, PAX and GNU long-name
  records, which ``tarfile`` reads whole into memory) at most :data:`TAR_HEADER_BYTES` more
  than the previous member's data may stream.
- Every entry name must be relative and stay inside the archive: no leading ``/``, no drive
  letter, no ``..`` component, no NUL (``\`` counts as a separator).
- Only regular files and directories: symbolic and hard links, devices, FIFOs, sparse tar
  members and encrypted zip entries are refused, wherever they sit.
- ``adapter_config.json`` and ``adapter_model.safetensors`` must each be at the root exactly
  once. Other entries that pass the checks above (``README.md`` that ``save_pretrained`` writes,
  a ``./`` directory entry, ``__MACOSX/`` metadata) are ignored: never extracted, never read
  (a tar's are decompressed to skip them, and count towards the cap). Weights present only as a
  pickle file (``adapter_model.bin``) are refused with a message saying so.
- A truncated or corrupt archive (bad CRC, bad gzip stream, bad header) is refused.

Memory stays bounded by the caps: members are decompressed in :data:`CHUNK`-byte pieces and
spooled to an anonymous temporary file (``spool_dir``), then read back once into one buffer of
their exact size; nothing is joined or held twice. The two files come back as bytes. CPU-bound:
run it off the event loop.
"""

from __future__ import annotations

import gzip
import os
import re
import stat
import struct
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

from loraplex.adapters.safetensors_io import PICKLE_SUFFIXES
from loraplex.adapters.validation import CONFIG_NAME, WEIGHTS_NAME

REQUIRED = (CONFIG_NAME, WEIGHTS_NAME)
CHUNK = 256 * 1024
"""Bytes decompressed per read."""
TAR_HEADER_BYTES = 1 << 20
"""Most bytes a tar may stream between two members beyond the previous member's data."""
_DRIVE = re.compile(r"^[A-Za-z]:")
# Bytes a zip's central directory may take per allowed member (46-byte record, name, extras).
_CD_BYTES_PER_MEMBER = 4096
# Tar headers (512 bytes each, PAX records) on top of the members' data.
_TAR_HEADER_BYTES_PER_MEMBER = 64 * 1024
_CORRUPT = (
    zipfile.BadZipFile,
    tarfile.TarError,
    zlib.error,
    EOFError,
    OSError,
    NotImplementedError,
    RuntimeError,
    struct.error,
)


class ArchiveError(ValueError):
    """The archive was refused; the message says why (HTTP 400)."""


@dataclass
class UnpackMeter:
    """What an unpack decompressed, for tests and benchmarks.

    Attributes:
        produced: Decompressed bytes read (for a tar, the whole stream: headers, skipped and
            read members).
        largest_read: The largest single piece read from a decompressor, in bytes.
    """

    produced: int = 0
    largest_read: int = 0

    def count(self, n: int) -> None:
        """Record one read of ``n`` bytes."""
        self.produced += n
        self.largest_read = max(self.largest_read, n)


def detect_format(head: bytes) -> str | None:
    """``"zip"``, ``"tar.gz"`` or None from an archive's first bytes (at least 4)."""
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[:2] == b"\x1f\x8b":
        return "tar.gz"
    return None


def unpack_adapter(
    fileobj: BinaryIO,
    *,
    max_members: int,
    max_unpacked_bytes: int,
    member_caps: Mapping[str, int] | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    meter: UnpackMeter | None = None,
) -> tuple[bytes, bytes]:
    """The adapter's two files from an archive (see the module docstring for the policy).

    Args:
        fileobj: The archive, readable and seekable, positioned anywhere.
        max_members: Most entries allowed.
        max_unpacked_bytes: Most decompressed bytes allowed in all.
        member_caps: Most bytes of ``adapter_config.json`` / ``adapter_model.safetensors``
            (each defaults to ``max_unpacked_bytes``).
        spool_dir: Where members are spooled while they are decompressed (the system's
            temporary directory if None); the files are anonymous and gone once read.
        meter: Filled with what was decompressed.

    Returns:
        ``(adapter_config.json bytes, adapter_model.safetensors bytes)``.

    Raises:
        ArchiveError: not a zip or tar.gz, unsafe, over a limit, corrupt, or without the files.
    """
    fileobj.seek(0)
    kind = detect_format(fileobj.read(4))
    fileobj.seek(0)
    picker = _Picker(
        max_members, max_unpacked_bytes, dict(member_caps or {}), spool_dir, meter or UnpackMeter()
    )
    try:
        if kind == "zip":
            _unpack_zip(fileobj, picker)
        elif kind == "tar.gz":
            _unpack_tar_gz(fileobj, picker)
        else:
            raise ArchiveError("the archive is neither a .zip nor a .tar.gz file")
    except ArchiveError:
        raise
    except _CORRUPT as exc:
        raise ArchiveError(f"the {kind} archive is corrupt or truncated ({exc})") from None
    return picker.result()


def member_path(name: str) -> str | None:
    """An entry's path relative to the archive root (``None`` for the root itself).

    Raises:
        ArchiveError: an absolute path, a ``..`` component or a NUL.
    """
    if not name or "\x00" in name:
        raise ArchiveError(f"archive entry {name!r} has an invalid name")
    unified = name.replace("\\", "/")
    if unified.startswith("/") or _DRIVE.match(unified):
        raise ArchiveError(f"archive entry {name!r} is an absolute path")
    parts = [p for p in unified.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(f"archive entry {name!r} points outside the archive ('..')")
    return "/".join(parts) or None


class _Picker:
    """Counts entries and bytes against the caps; keeps the two files."""

    def __init__(
        self,
        max_members: int,
        max_unpacked_bytes: int,
        member_caps: dict[str, int],
        spool_dir: str | os.PathLike[str] | None,
        meter: UnpackMeter,
    ) -> None:
        self.max_members = max_members
        self.max_bytes = max_unpacked_bytes
        self.member_caps = member_caps
        self.spool_dir = spool_dir
        self.meter = meter
        self.members = 0
        self.unpacked = 0
        self.files: dict[str, bytes] = {}
        self.others: list[str] = []

    def count_member(self) -> None:
        self.members += 1
        if self.members > self.max_members:
            raise ArchiveError(f"the archive has more than {self.max_members} entries")

    def count_bytes(self, n: int) -> None:
        self.unpacked += n
        if self.unpacked > self.max_bytes:
            raise ArchiveError(f"the archive unpacks to more than {self.max_bytes} bytes")

    def wants(self, path: str) -> bool:
        """Whether to read this regular file (one of the two, at the root, first time)."""
        if path in REQUIRED:
            if path in self.files:
                raise ArchiveError(f"the archive holds {path} twice")
            return True
        self.others.append(path)
        return False

    def cap(self, path: str) -> int:
        """Most bytes the member ``path`` (one of the two files) may unpack to."""
        return min(self.member_caps.get(path, self.max_bytes), self.max_bytes)

    def check_declared(self, path: str, size: int) -> None:
        """Refuse a member whose declared size is already over its cap (before inflating it)."""
        if size > self.cap(path):
            raise self.too_large(path)

    def too_large(self, path: str) -> ArchiveError:
        cap = self.cap(path)
        if cap < self.max_bytes:
            return ArchiveError(
                f"{path} in the archive unpacks to more than {cap} bytes, more than a valid "
                f"{path} for the served model can weigh"
            )
        return ArchiveError(f"the archive unpacks to more than {self.max_bytes} bytes")

    def read(self, path: str, stream: BinaryIO, meter_reads: bool = True) -> None:
        """Decompress one member chunk by chunk into a spool file, then into one buffer."""
        cap, size = self.cap(path), 0
        with tempfile.TemporaryFile(dir=self.spool_dir) as spool:
            while chunk := stream.read(CHUNK):
                if meter_reads:
                    self.meter.count(len(chunk))
                size += len(chunk)
                if size > cap:
                    raise self.too_large(path)
                self.count_bytes(len(chunk))
                spool.write(chunk)
            spool.seek(0)
            self.files[path] = spool.read()

    def result(self) -> tuple[bytes, bytes]:
        for required in REQUIRED:
            if required in self.files:
                continue
            nested = [p for p in self.others if p.rsplit("/", 1)[-1] == required]
            pickles = [
                p for p in self.others if "/" not in p and p.lower().endswith(PICKLE_SUFFIXES)
            ]
            if required == WEIGHTS_NAME and pickles:
                raise ArchiveError(
                    f"adapter weights {pickles[0]} are a pickle file; only {WEIGHTS_NAME} is "
                    "accepted (save with safe_serialization=True)"
                )
            if nested:
                raise ArchiveError(
                    f"{required} must be at the archive's root, found {nested[0]} (archive the "
                    "adapter directory's contents, not the directory)"
                )
            raise ArchiveError(f"the archive has no {required} at its root")
        return self.files[CONFIG_NAME], self.files[WEIGHTS_NAME]


# ----------------------------------------------------------------------------------- zip
def _zip_directory(fileobj: BinaryIO) -> tuple[int, int]:
    """``(entries, central directory bytes)`` from the end record :mod:`zipfile` will use.

    Mirrors ``zipfile``: the end record at ``size - 22`` if it ends the file, else the last one
    in the final 64 KiB; a ZIP64 locator right before it takes precedence.
    """
    size = fileobj.seek(0, 2)
    tail_len = min(size, 22 + 65535)
    fileobj.seek(size - tail_len)
    tail = fileobj.read(tail_len)
    if tail[-22:-18] == b"PK\x05\x06" and tail[-2:] == b"\x00\x00":
        pos = len(tail) - 22
    else:
        pos = tail.rfind(b"PK\x05\x06")
        if pos < 0 or len(tail) - pos < 22:
            raise ArchiveError("the zip archive is corrupt or truncated (no end record)")
    entries, cd_size = struct.unpack("<HI", tail[pos + 10 : pos + 16])
    eocd = size - tail_len + pos
    if eocd >= 20:
        fileobj.seek(eocd - 20)
        locator = fileobj.read(20)
        if locator[:4] == b"PK\x06\x07":
            (offset,) = struct.unpack("<Q", locator[8:16])
            fileobj.seek(offset)
            record = fileobj.read(56)
            if len(record) < 56 or record[:4] != b"PK\x06\x06":
                raise ArchiveError("the zip archive is corrupt or truncated (bad ZIP64 record)")
            entries, cd_size = struct.unpack("<QQ", record[32:48])
    return entries, cd_size


def _unpack_zip(fileobj: BinaryIO, picker: _Picker) -> None:
    entries, cd_size = _zip_directory(fileobj)
    if entries > picker.max_members or cd_size > picker.max_members * _CD_BYTES_PER_MEMBER:
        raise ArchiveError(f"the archive has more than {picker.max_members} entries")
    fileobj.seek(0)
    with zipfile.ZipFile(fileobj) as archive:
        infos = archive.infolist()
        for info in infos:
            picker.count_member()
            member_path(info.filename)
            kind = stat.S_IFMT(info.external_attr >> 16)  # 0: permissions only, or not Unix
            if kind == stat.S_IFLNK:
                raise ArchiveError(f"archive entry {info.filename!r} is a symbolic link")
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise ArchiveError(f"archive entry {info.filename!r} is not a regular file")
            if info.flag_bits & 0x1:
                raise ArchiveError(f"archive entry {info.filename!r} is encrypted")
        for info in infos:
            path = member_path(info.filename)
            if path is None or info.is_dir() or not picker.wants(path):
                continue
            picker.check_declared(path, info.file_size)
            with archive.open(info) as stream:
                picker.read(path, stream)


# ------------------------------------------------------------------------------- tar.gz
class _CappedReader:
    """A read-only stream that refuses to produce more than ``limit`` bytes in all.

    Nor more than the current phase allows (see :meth:`begin_phase`).
    """

    def __init__(self, raw: BinaryIO, limit: int, meter: UnpackMeter) -> None:
        self.raw = raw
        self.limit = limit
        self.meter = meter
        self.count = 0
        self.phase_limit = TAR_HEADER_BYTES
        self.phase_count = 0

    def begin_phase(self, limit: int) -> None:
        """From now until the next call, at most ``limit`` more bytes may be read."""
        self.phase_limit = limit
        self.phase_count = 0

    def read(self, size: int = -1) -> bytes:
        room = min(self.limit - self.count, self.phase_limit - self.phase_count) + 1
        data = self.raw.read(room if size is None or size < 0 else min(size, room))
        self.meter.count(len(data))
        self.count += len(data)
        self.phase_count += len(data)
        if self.count > self.limit:
            raise ArchiveError(f"the archive unpacks to more than {self.limit} bytes")
        if self.phase_count > self.phase_limit:
            raise ArchiveError(
                f"the archive has a tar header block (PAX or long name record) larger than "
                f"{TAR_HEADER_BYTES} bytes"
            )
        return data


def _blocks(size: int) -> int:
    """``size`` rounded up to whole 512-byte tar blocks."""
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def _unpack_tar_gz(fileobj: BinaryIO, picker: _Picker) -> None:
    limit = picker.max_bytes + (picker.max_members + 4) * _TAR_HEADER_BYTES_PER_MEMBER
    stream = _CappedReader(gzip.GzipFile(fileobj=fileobj, mode="rb"), limit, picker.meter)
    with tarfile.open(fileobj=stream, mode="r|") as archive:  # type: ignore[call-overload]
        for member in archive:
            picker.count_member()
            path = member_path(member.name)
            if member.issym() or member.islnk():
                raise ArchiveError(f"archive entry {member.name!r} is a link")
            if member.issparse() or not (member.isreg() or member.isdir()):
                raise ArchiveError(f"archive entry {member.name!r} is not a regular file")
            # this member's data (read or skipped), then the next member's header blocks
            stream.begin_phase(_blocks(member.size) + TAR_HEADER_BYTES)
            if member.isdir():
                continue
            wanted = path is not None and picker.wants(path)
            if wanted:
                picker.check_declared(path, member.size)
            if not wanted:
                picker.count_bytes(member.size)  # decompressed to skip it
                continue
            extracted = archive.extractfile(member)
            assert extracted is not None  # a regular file
            picker.read(path, extracted, meter_reads=False)  # the stream counts them
