"""The usage spool: an append-only local log that makes a usage row durable in one fsync.

A response is only sent once its usage row is durable (``docs/usage.md``). Committing each row
to the database first would cost a transaction per request and stop serving when the database
is down; instead rows are appended here, and many requests share one ``write`` + ``fdatasync``
(group commit, see ``UsageWriter``; several syncs may run at once, each covering what was
written before it began). The database writer drains the rows later; a segment whose
rows are all in the database is deleted. Rows still here when the process dies (SIGKILL, OOM,
power loss) are read back at the next start and written again: ``INSERT ... ON CONFLICT
(request_id) DO NOTHING`` makes that idempotent, ``request_id`` being the server's own id.

Layout of ``DIR`` (``DATA/usage-spool/``, mode 0700)::

    <writer>.lock            flock()ed by the live process that owns <writer> (its id)
    <writer>-00000001.spool  segments, appended in order; a new one past ``segment_bytes``
    <writer>-00000002.spool  and at every start (a torn tail is never appended to)

Each record is one line: the CRC-32 of its JSON in 8 hex digits, a space, the JSON of the
``UsageRecord``, a newline (JSON escapes control characters, so a record never holds one). A
SIGKILL in the middle of a ``write`` leaves at most the records of that last batch torn at the
end of the segment: a line without its newline, or whose checksum does not match, is skipped
when read back and counted in one log line. Those are exactly records whose requests never got
their response, since a response waits for its batch's ``fdatasync``.

Several processes may share the data directory: each writes only its own segments, and at
start-up a process adopts the segments of every writer whose lock it can take (a dead one),
renaming them into its own name space before reading them. A lock file appears (by rename)
only once its owner holds it, so a live writer is never adopted.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgspec

from loraplex.gateway.usage.records import UsageRecord

logger = logging.getLogger(__name__)

SPOOL_DIRNAME = "usage-spool"
SUFFIX = ".spool"
LOCK_SUFFIX = ".lock"


def encode_record(record: UsageRecord) -> bytes:
    """One spool line for ``record`` (its strings must be UTF-8 encodable: ``record.safe()``)."""
    payload = msgspec.json.encode(record)
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def decode_line(line: bytes) -> UsageRecord | None:
    """The record of one spool line (without its newline); None if torn or corrupt."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    payload = line[9:]
    try:
        if int(line[:8], 16) != zlib.crc32(payload):
            return None
        record = msgspec.json.decode(payload, type=UsageRecord)
        record.validate()
    except Exception:  # a bad checksum field, JSON, type or value: the same, unreadable
        return None
    return record


def read_segment(path: Path) -> tuple[list[UsageRecord], int]:
    """Every intact record of a segment, in order, and how many lines were torn or corrupt."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    bad = 1 if lines[-1] else 0  # bytes after the last newline: a torn last record
    records = []
    for line in lines[:-1]:
        record = decode_line(line)
        if record is None:
            bad += 1
        else:
            records.append(record)
    return records, bad


@dataclass
class _Segment:
    path: Path
    last_seq: int = 0  # the highest sequence number in it (0: none)
    size: int = 0
    fd: int | None = None  # open while written to, or while a sync on it runs
    syncing: int = 0  # syncs in flight on ``fd``
    retired: bool = False  # no more writes: ``fd`` closes when the last sync ends
    dir_synced: bool = False  # its directory entry is durable


class UsageSpool:
    """One process's spool in ``directory`` (see the module docstring).

    Sequence numbers are the writer's: the n-th record ever handed to this spool (replayed ones
    first) has number n. :meth:`release` deletes the segments whose records are all at or below
    the number the database has written through.

    Args:
        directory: The spool directory (created 0700).
        segment_bytes: A segment is closed once it holds this many bytes.
        fsync: ``fdatasync`` after each batch (durable through power loss); False only writes
            (durable through a process crash, not an OS crash).
    """

    def __init__(self, directory: Path, *, segment_bytes: int = 1 << 20, fsync: bool = True):
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.writer_id = uuid.uuid4().hex[:12]
        self._lock_fd: int | None = None
        self._next_number = 1
        self._closed: list[_Segment] = []  # full segments, oldest first
        self._current: _Segment | None = None
        self._mutex = threading.Lock()  # segment lists and sync counts: loop and sync threads
        self.torn = 0  # torn or corrupt lines skipped at start-up

    # ------------------------------------------------------------------ start-up
    def open(self) -> list[UsageRecord]:
        """Take this process's lock, adopt dead writers' segments and read them back.

        Returns:
            The records found, oldest segment first; they get sequence numbers 1..n.

        Raises:
            OSError: the directory cannot be created or written.
        """
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._take_lock()
        adopted = self._adopt()
        records: list[UsageRecord] = []
        for path in adopted:
            found, bad = read_segment(path)
            if bad:
                self.torn += bad
                logger.warning("usage spool %s: skipped %d torn or corrupt record(s)", path, bad)
            if found:
                records.extend(found)
                self._closed.append(_Segment(path, len(records), path.stat().st_size))
            else:
                path.unlink(missing_ok=True)
        if records:
            logger.info("usage spool: %d row(s) from an earlier run to write", len(records))
        return records

    def _take_lock(self) -> None:
        """Create ``<writer>.lock`` already locked (by rename), so no one adopts us."""
        while True:
            tmp = self.directory / f".{self.writer_id}{LOCK_SUFFIX}.tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            final = self.directory / f"{self.writer_id}{LOCK_SUFFIX}"
            if not final.exists():
                try:
                    os.rename(tmp, final)
                    self._lock_fd = fd
                    return
                except FileNotFoundError:  # removed as stale before we locked it: again
                    pass
            os.close(fd)  # an id clash (never in practice): another id
            tmp.unlink(missing_ok=True)
            self.writer_id = uuid.uuid4().hex[:12]

    def _adopt(self) -> list[Path]:
        """Rename every dead writer's segments into ours, in order; returns their new paths."""
        writers = {p.name.rsplit("-", 1)[0] for p in self.directory.glob(f"*{SUFFIX}")}
        writers |= {p.name[: -len(LOCK_SUFFIX)] for p in self.directory.glob(f"*{LOCK_SUFFIX}")}
        writers.discard(self.writer_id)
        for tmp in self.directory.glob(f".*{LOCK_SUFFIX}.tmp"):  # a start that died at once
            _remove_if_unlocked(tmp)
        adopted = []
        for writer in sorted(writers):
            lock_path = self.directory / f"{writer}{LOCK_SUFFIX}"
            fd = None
            try:
                fd = os.open(lock_path, os.O_RDWR)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except FileNotFoundError:
                fd = None  # its owner finished, or was adopted mid-way: the segments are free
            except BlockingIOError:
                os.close(fd)  # alive
                continue
            for old in sorted(self.directory.glob(f"{writer}-*{SUFFIX}")):
                new = self._segment_path()
                os.rename(old, new)
                adopted.append(new)
            for partial in self.directory.glob(f".{writer}-*{SUFFIX}.tmp"):  # a compaction
                partial.unlink(missing_ok=True)  # cut short: its old segments are all there
            _fsync_dir(self.directory)
            if fd is not None:
                lock_path.unlink(missing_ok=True)
                os.close(fd)
        return adopted

    # ----------------------------------------------------------------- appending
    def _segment_path(self) -> Path:
        path = self.directory / f"{self.writer_id}-{self._next_number:08d}{SUFFIX}"
        self._next_number += 1
        return path

    def append(self, data: bytes, last_seq: int) -> None:
        """:meth:`write` then :meth:`sync` (blocking: call it from a thread).

        Raises:
            OSError: see :meth:`write` and :meth:`sync`.
        """
        self.sync(self.write(data, last_seq))

    def write(self, data: bytes, last_seq: int) -> _Segment:
        """Append encoded records to the current segment (the page cache: microseconds).

        Writes happen in call order (one thread: the event loop's). Every call must be
        followed by one :meth:`sync` of the segment it returns; several syncs may run at once
        in other threads (each covers everything written before it began, so concurrent syncs
        share the disk's flushes: group commit, pipelined).

        Args:
            data: Whole lines (:func:`encode_record`).
            last_seq: The sequence number of the last record in ``data``.

        Returns:
            The segment written to (for :meth:`sync`).

        Raises:
            OSError: the write failed (disk full); the segment is cut back to its last whole
                record (or abandoned), so the next write is clean.
        """
        segment = self._current
        if segment is None or segment.fd is None or segment.size >= self.segment_bytes:
            segment = self._rotate()
        assert segment.fd is not None
        before = segment.size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(segment.fd, view) :]
        except OSError:
            try:
                os.ftruncate(segment.fd, before)
            except OSError:  # cannot even cut it: never write to this segment again
                segment.size = self.segment_bytes
            raise
        with self._mutex:
            segment.size = before + len(data)
            segment.last_seq = max(segment.last_seq, last_seq)
            segment.syncing += 1
        return segment

    def sync(self, segment: _Segment) -> None:
        """Make what was written to ``segment`` durable (``fdatasync``; blocking).

        Raises:
            OSError: the sync failed; the segment is never written to again (after a failed
                ``fsync`` the kernel may have dropped the pages), and what it holds counts as
                not durable.
        """
        try:
            if self.fsync:
                assert segment.fd is not None
                os.fdatasync(segment.fd)
                if not segment.dir_synced:  # a new segment: its name must survive too
                    _fsync_dir(self.directory)
                    segment.dir_synced = True
        except OSError:
            segment.size = self.segment_bytes
            raise
        finally:
            with self._mutex:
                segment.syncing -= 1
                if segment.retired and segment.syncing == 0:
                    _close_fd(segment)

    def _rotate(self) -> _Segment:
        """Retire the current segment (kept until released) and open a new one."""
        path = self._segment_path()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        with self._mutex:
            old = self._current
            if old is not None:
                old.retired = True
                if old.syncing == 0:
                    _close_fd(old)
                if old.last_seq:
                    self._closed.append(old)
                else:
                    old.path.unlink(missing_ok=True)
            self._current = _Segment(path, fd=fd, dir_synced=not self.fsync)
            return self._current

    # ----------------------------------------------------------------- releasing
    def releasable(self, written_seq: int) -> bool:
        """Whether :meth:`release` would delete a segment."""
        closed = self._closed
        return bool(closed) and closed[0].last_seq <= written_seq

    def release(self, written_seq: int) -> int:
        """Delete the closed segments whose records are all written; returns how many."""
        with self._mutex:
            done = [s for s in self._closed if s.last_seq <= written_seq]
            self._closed = [s for s in self._closed if s.last_seq > written_seq]
        for segment in done:
            segment.path.unlink(missing_ok=True)
        return len(done)

    def close(self, written_seq: int, unwritten: list[bytes] | None = None) -> int:
        """Release what is written, then unlock; the rest waits for the next start.

        Args:
            written_seq: Every record up to this number is in the database.
            unwritten: The encoded records not in the database (all of them, in order), if
                known: they are rewritten into one new segment and every other segment is
                deleted (compaction: the next start replays only these). Otherwise segments
                holding any unwritten record are kept whole.

        Returns:
            How many records (at most) the next start reads back.
        """
        current, self._current = self._current, None
        for segment in (*self._closed, *([current] if current else [])):
            _close_fd(segment)  # no sync runs now: the writer has stopped
        if current is not None:
            if current.last_seq <= written_seq:
                current.path.unlink(missing_ok=True)
            else:
                self._closed.append(current)
        if unwritten is not None:
            left = len(unwritten)
            old, self._closed = self._closed, []
            if unwritten:
                self._write_segment(b"".join(unwritten))
            for segment in old:
                segment.path.unlink(missing_ok=True)
        else:
            self.release(written_seq)
            left = max(0, max((s.last_seq for s in self._closed), default=0) - written_seq)
        if self._lock_fd is not None:
            (self.directory / f"{self.writer_id}{LOCK_SUFFIX}").unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None
        return left

    def _write_segment(self, data: bytes) -> None:
        """A whole new segment holding ``data``, durable before it appears (tmp + rename)."""
        path = self._segment_path()
        tmp = path.with_name("." + path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        _fsync_dir(self.directory)


def _close_fd(segment: _Segment) -> None:
    if segment.fd is not None:
        os.close(segment.fd)
        segment.fd = None


def _remove_if_unlocked(path: Path) -> None:
    """Delete a lock file nobody holds."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink(missing_ok=True)
    except BlockingIOError:
        pass
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    """Make renames and new files in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
