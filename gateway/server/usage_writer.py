"""Usage events written in the background, in batches, off the request path.

A request hands its :class:`UsageRecord` to :meth:`UsageWriter.submit` (no I/O, never fails the
request) and the writer task inserts whatever has queued up in one transaction, at most
``flush_seconds`` later. ``GET /v1/usage`` and shutdown call :meth:`flush` first, so a client that
reads its usage right after a response sees it. Inserts are keyed by request id (``ON CONFLICT
DO NOTHING``), so a retried request is counted once. A batch the database refuses is retried
(with back-off), never dropped while the process lives.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.services.usage import UsageRecord, record_usage_batch

logger = logging.getLogger(__name__)


class UsageWriter:
    """Batches usage events into the database.

    Args:
        sessions: The async session factory.
        flush_seconds: Longest an event waits before its batch is written.
        max_batch: Most events per transaction.
    """

    def __init__(
        self, sessions: async_sessionmaker, *, flush_seconds: float = 0.05, max_batch: int = 512
    ) -> None:
        self._sessions = sessions
        self._flush_seconds = flush_seconds
        self._max_batch = max_batch
        self._pending: list[UsageRecord] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._urgent = asyncio.Event()
        self.written = 0

    def start(self) -> None:
        """Start the writer task on the running loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="loraplex-usage-writer")

    def submit(self, record: UsageRecord) -> None:
        """Queue one event (validated now: a bad record is a bug, raised to the caller).

        Raises:
            InvalidInputError: the record is malformed.
        """
        record.validate()
        self._pending.append(record)
        self._idle.clear()
        self._wake.set()

    @property
    def pending(self) -> int:
        """Events not yet written."""
        return len(self._pending)

    async def flush(self) -> None:
        """Wait until every event submitted so far is written."""
        if self._task is None or self._task.done():
            await self._write_all()
            return
        self._urgent.set()
        self._wake.set()
        await self._idle.wait()

    async def close(self) -> None:
        """Write what is queued, then stop the task."""
        self._closing = True
        self._urgent.set()
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=30)
            except TimeoutError:
                logger.error("usage writer did not finish; %d events unwritten", self.pending)
            self._task = None
        await self._write_all()

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
                await self._write_all()
                delay = 0.0
            except Exception:  # the database is down: keep the events, try again later
                delay = min(5.0, max(0.1, delay * 2))
                logger.exception("writing usage failed; retrying in %.1f s", delay)
                if self._closing:
                    return
                await asyncio.sleep(delay)
                self._wake.set()
                continue
            if self._closing:
                return

    async def _write_all(self) -> None:
        while self._pending:
            batch = self._pending[: self._max_batch]
            async with self._sessions() as session, session.begin():
                await record_usage_batch(session, batch)
            del self._pending[: len(batch)]
            self.written += len(batch)
        self._idle.set()
