"""Usage rows: durable before the response ends (the spool), then written to the database.

A request hands its :class:`UsageRecord` to :meth:`UsageWriter.submit` and gets a future that
completes once the row is durable; the chat route sends its last bytes only after that
(``docs/usage.md``). Two tasks do the work:

- group commit (:class:`~gateway.usage.commit.GroupCommit`): the records submitted
  since the last batch are appended to the :class:`~gateway.usage.spool.UsageSpool` in
  one ``write`` and one ``fdatasync`` (in a sync thread; several at once), then their futures
  complete. Under load a sync carries every request that finished meanwhile, so the cost per
  request falls as the load rises;
- the database task: gathers records for ``flush_seconds`` after the first arrives, then
  inserts them (``max_batch`` per transaction; ``INSERT ... ON CONFLICT (request_id) DO
  NOTHING``, ``request_id`` being the server's id, so a record written twice, e.g. replayed
  from the spool after a crash, is counted once). A segment of the spool is deleted once all
  its records are in the database.

Failures, told apart by :mod:`gateway.db.errors`:

- database unreachable: the records stay (in the spool and in memory) and the write is tried
  again with back-off (0.1 s doubling to 5 s); one log line when the outage starts and one when
  it ends. Requests go on being served. ``GET /v1/usage`` (a :meth:`flush`) gets 503 +
  ``Retry-After`` meanwhile; past ``backlog_limit`` records waiting, :meth:`admit` refuses new
  chat requests the same way;
- a row refused (a value or a constraint the database rejects): the batch is split in halves
  until the refused rows are alone; each is set aside in the dead-letter file
  (``DATA/usage-dead-letter.jsonl``, one JSON line with the error) with one log line, and
  everything else is written. Nothing is retried forever and nothing blocks the rows behind it;
- the spool cannot be written (disk full): one log line; those requests wait for their rows to
  reach the database instead, and get 503 if it is unreachable too.

Without a spool (``spool=None``) the database transaction is the durability point: a submitted
record's future completes when its row is committed (records arriving during a transaction go
in the next, so this is group commit too).

``GET /v1/usage`` and shutdown call :meth:`flush` first, which skips the window and returns once
every record submitted before the call is in the database, so a client that reads its usage
right after a response sees it. Shutdown writes what it can; rows it cannot write stay in the
spool and are written at the next start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from sqlalchemy import text

from loraplex.gateway.db.errors import describe, is_unreachable
from loraplex.gateway.db.types import utcnow
from loraplex.gateway.errors import APIError
from loraplex.gateway.usage.commit import GroupCommit
from loraplex.gateway.usage.records import UsageRecord, record_usage_batch
from loraplex.gateway.usage.spool import UsageSpool, encode_record

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 2
MAX_RETRY_DELAY_S = 5.0
CLOSE_TIMEOUT_S = 30.0


class UsageUnavailable(APIError):
    """Usage cannot be recorded or read now: 503 with ``Retry-After`` (OpenAI's error body).

    Args:
        message: Shown to the client.
        code: ``usage_unavailable`` (database unreachable), ``usage_backlog_full``.
    """

    def __init__(self, message: str, code: str = "usage_unavailable") -> None:
        super().__init__(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


class UsageWriter:
    """Makes usage records durable (spool) and writes them to the database in batches.

    Args:
        sessions: The async session factory.
        spool: The local spool (None: durable only once in the database).
        dead_letter: The file refused rows are appended to (None: only the log line, which
            then carries the row).
        flush_seconds: How long the database task gathers records after the first arrives.
        max_batch: Most records per transaction.
        backlog_limit: Most records waiting for the database before :meth:`admit` refuses.

    Attributes:
        submitted: Records so far (replayed ones included); the n-th has sequence number n.
        written: Records done with, in order: in the database or set aside (a sequence number:
            every record up to it is done).
        transactions: Write transactions committed.
        replayed: Records read back from the spool at start-up.
        dead_lettered: Records the database refused, set aside.
        outage_since: ``time.monotonic()`` when the database became unreachable, else None.
    """

    def __init__(
        self,
        sessions: Callable[[], Any],
        *,
        spool: UsageSpool | None = None,
        dead_letter: Path | None = None,
        flush_seconds: float = 0.2,
        max_batch: int = 512,
        backlog_limit: int = 100_000,
    ) -> None:
        self._sessions = sessions
        self._spool = spool
        self._dead_letter = dead_letter
        self._flush_seconds = flush_seconds
        self._max_batch = max_batch
        self._backlog_limit = backlog_limit
        self._pending: list[tuple[int, UsageRecord]] = []  # not in the database yet
        self._db_durable: list[tuple[int, asyncio.Future[None]]] = []  # wait for the database
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []  # flush() calls
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._commit: GroupCommit | None = None
        self._closing = False
        self.submitted = self.written = self.transactions = 0
        self.replayed = self.dead_lettered = 0
        self.outage_since: float | None = None

    # -------------------------------------------------------------- public side
    def start(self) -> None:
        """Read back the spool (rows of an earlier run) and start the tasks on this loop.

        Raises:
            OSError: the spool directory cannot be created or read.
        """
        if self._task is not None:
            return
        if self._spool is not None:
            for record in self._spool.open():
                self.submitted += 1
                self._pending.append((self.submitted, record))
            self.replayed = self.submitted
            self._commit = GroupCommit(self._spool, self._spool_failed)
            self._commit.start()
        self._task = asyncio.create_task(self._run(), name="loraplex-usage-writer")
        if self._pending:
            self._wake.set()

    def admit(self) -> None:
        """Refuse new work while too many rows wait for an unreachable database.

        Raises:
            UsageUnavailable: ``backlog_limit`` records are waiting.
        """
        if len(self._pending) >= self._backlog_limit:
            raise UsageUnavailable(
                "usage cannot be recorded now (the usage database is unreachable); retry later",
                code="usage_backlog_full",
            )

    def submit(self, record: UsageRecord) -> asyncio.Future[None]:
        """Queue one record; the future completes once it is durable.

        The record is made storable (:meth:`UsageRecord.safe`) and stamped with the time now
        unless it has one. The future fails with :class:`UsageUnavailable` only when neither
        the spool nor the database could take it (it stays queued for the database).

        Raises:
            InvalidInputError: the record is malformed (a bug in the caller).
        """
        record = record.safe()
        record.validate()
        if record.created_at is None:
            record = dataclasses.replace(record, created_at=utcnow())
        self.submitted += 1
        seq = self.submitted
        self._pending.append((seq, record))
        self._wake.set()
        durable: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._commit is not None and self._commit.running:
            self._commit.add(encode_record(record), durable, seq)
        else:
            self._db_durable.append((seq, durable))
            self._urgent.set()
        return durable

    @property
    def syncs(self) -> int:
        """Spool batches made durable (each one ``fdatasync``)."""
        return 0 if self._commit is None else self._commit.syncs

    @property
    def spooled(self) -> int:
        """Records made durable in the spool."""
        return 0 if self._commit is None else self._commit.spooled

    @property
    def pending(self) -> int:
        """Records not yet in the database."""
        return len(self._pending)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every record submitted before this call is in the database.

        Without a running writer task (not started, or closed) the records are written here.

        Args:
            timeout: Seconds to wait at most (None: no limit).

        Raises:
            UsageUnavailable: the database is unreachable, or ``timeout`` passed.
        """
        target = self.submitted
        if self.written >= target:
            return
        if self._task is None or self._task.done():
            try:
                await self._write(len(self._pending))
            except Exception as exc:
                if not is_unreachable(exc):
                    raise
                raise UsageUnavailable(_UNREACHABLE) from exc
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, done))
        self._urgent.set()
        self._wake.set()
        try:
            await asyncio.wait_for(done, timeout)
        except TimeoutError:
            raise UsageUnavailable("usage is still being written; retry later") from None

    async def close(self) -> None:
        """Make queued records durable, write what the database takes, then stop.

        Never raises: records the database cannot take now stay in the spool (written at the
        next start) or, without a spool, are reported lost in one log line. Flushes still
        waiting fail with :class:`UsageUnavailable`.
        """
        if self._commit is not None:
            try:
                await self._commit.close()  # what is queued becomes durable first
            except Exception:  # a bug there; the rows are still in memory, written below
                logger.exception("closing the usage spool's group commit failed")
        self._closing = True
        self._urgent.set()
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), CLOSE_TIMEOUT_S)
            except TimeoutError:
                logger.error("usage writer did not finish; %d rows unwritten", self.pending)
        self._task = None
        try:
            await self._write(len(self._pending))
        except Exception as exc:
            logger.warning("writing usage at shutdown failed: %s", describe(exc))
        finally:
            self._fail_waiters(UsageUnavailable("the usage writer closed before writing"))
            if self._spool is not None:
                unwritten = [encode_record(record) for _, record in self._pending]
                left = self._spool.close(self.written, unwritten)
                if left:
                    logger.warning(
                        "%d usage row(s) stay in the spool %s; written at the next start",
                        left,
                        self._spool.directory,
                    )
            elif self._pending:
                logger.error("%d usage row(s) lost: no spool, database down", self.pending)

    def _spool_failed(self, futures: list[asyncio.Future[None]], last: int) -> None:
        """A batch the spool could not take: its requests wait for the database instead."""
        self._db_durable.extend((last, f) for f in futures)
        self._urgent.set()
        self._wake.set()

    # ------------------------------------------------------------ the database
    async def _run(self) -> None:
        delay = 0.0
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._urgent.is_set() and delay == 0.0 and self._flush_seconds > 0:
                try:  # gather a batch, unless a flush() or close() is waiting
                    await asyncio.wait_for(self._urgent.wait(), self._flush_seconds)
                except TimeoutError:
                    pass
            self._urgent.clear()
            try:
                await self._write(len(self._pending))  # later arrivals wait for the next window
            except Exception as exc:  # unreachable (refusals are set aside inside)
                self._outage(exc)
                if self._closing:
                    return
                delay = min(MAX_RETRY_DELAY_S, max(0.1, delay * 2))
                await asyncio.sleep(0.05)  # an urgent flush retries sooner, never in a loop
                try:
                    await asyncio.wait_for(self._urgent.wait(), delay)
                except TimeoutError:
                    pass
                self._wake.set()
                continue
            if self.outage_since is not None:
                logger.warning(
                    "usage database reachable again after %.1f s; backlog written",
                    time.monotonic() - self.outage_since,
                )
                self.outage_since = None
            delay = 0.0
            if self._closing:
                return
            if self._pending:
                self._wake.set()
                if self._waiters or self._db_durable:
                    self._urgent.set()

    def _outage(self, exc: Exception) -> None:
        """The database is unreachable: one log line, and what waits on it fails now."""
        if not is_unreachable(exc):  # a bug in this module, not the database
            logger.error("writing usage failed: %s", describe(exc), exc_info=exc)
        elif self.outage_since is None:
            where = "in the spool" if self._spool is not None else "in memory only"
            logger.warning(
                "usage database unreachable (%s): %d row(s) kept %s; retrying",
                describe(exc),
                self.pending,
                where,
            )
        if self.outage_since is None:
            self.outage_since = time.monotonic()
        self._fail_waiters(UsageUnavailable(_UNREACHABLE))

    async def _write(self, count: int) -> None:
        """Write the first ``count`` pending records, ``max_batch`` per transaction.

        Raises:
            Exception: the database is unreachable (what was written stays written).
        """
        while count > 0 and self._pending:
            batch = self._pending[: min(count, self._max_batch)]
            await self._write_isolating(batch)
            del self._pending[: len(batch)]
            count -= len(batch)
            self.written = batch[-1][0]
            self._release_waiters()
            if self._spool is not None and self._spool.releasable(self.written):
                if await self._database_synced():
                    self._spool.release(self.written)

    async def _write_isolating(self, batch: list[tuple[int, UsageRecord]]) -> None:
        """Write ``batch``; a refused one is split until each refused row is set aside.

        Raises:
            Exception: the database is unreachable.
        """
        try:
            async with self._sessions() as session, session.begin():
                await record_usage_batch(session, [record for _, record in batch])
            self.transactions += 1
            return
        except Exception as exc:
            if is_unreachable(exc):
                raise
            if len(batch) == 1:
                await self._set_aside(batch[0][1], exc)
                return
        half = len(batch) // 2
        await self._write_isolating(batch[:half])
        await self._write_isolating(batch[half:])

    async def _set_aside(self, record: UsageRecord, exc: Exception) -> None:
        """Append a refused row to the dead-letter file, with one log line."""
        line = msgspec.json.encode(
            {"at": utcnow().isoformat(), "error": describe(exc, 500), "record": record}
        )
        self.dead_lettered += 1
        where = None
        if self._dead_letter is not None:
            try:
                await asyncio.to_thread(_append_durably, self._dead_letter, line + b"\n")
                where = self._dead_letter
            except OSError as write_error:
                logger.error("cannot write the usage dead letter: %s", write_error)
        logger.error(
            "usage row %s refused by the database (%s); set aside %s",
            record.request_id,
            describe(exc),
            f"in {where}" if where else f"here: {line.decode()}",
        )

    async def _database_synced(self) -> bool:
        """Whether what is committed survives power loss (so spool segments may go).

        PostgreSQL's commit is already synced. SQLite runs with ``synchronous=NORMAL`` in WAL
        mode, where a commit survives a process crash but the WAL is only synced at a
        checkpoint: a passive checkpoint that copies every frame syncs it.
        """
        try:
            async with self._sessions() as session:
                if session.get_bind().dialect.name != "sqlite":
                    return True
                busy, log, done = (
                    await session.execute(text("PRAGMA wal_checkpoint(PASSIVE)"))
                ).one()
                return busy == 0 and log == done
        except Exception as exc:  # keep the segments; the next batch tries again
            logger.debug("checkpoint before releasing the usage spool failed: %s", exc)
            return False

    # ---------------------------------------------------------------- waiters
    def _release_waiters(self) -> None:
        """Complete the flushes and durability waits whose records are all written."""
        written = self.written
        if self._waiters:
            self._waiters = _complete_upto(self._waiters, written)
        if self._db_durable:
            self._db_durable = _complete_upto(self._db_durable, written)

    def _fail_waiters(self, error: Exception) -> None:
        for _, future in (*self._waiters, *self._db_durable):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: no "never retrieved" noise if nobody awaits
        self._waiters, self._db_durable = [], []


_UNREACHABLE = "the usage database is unreachable; retry later"


def _complete_upto(
    waiters: list[tuple[int, asyncio.Future[None]]], written: int
) -> list[tuple[int, asyncio.Future[None]]]:
    still = []
    for target, future in waiters:
        if written >= target:
            if not future.done():
                future.set_result(None)
        else:
            still.append((target, future))
    return still


def _append_durably(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` (created 0600) and sync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, data)
        os.fdatasync(fd)
    finally:
        os.close(fd)
