"""Usage events written in the background, in batches, off the request path.

A request hands its :class:`UsageRecord` to :meth:`UsageWriter.submit` (no I/O, never fails the
request). The writer task gathers events for ``flush_seconds`` after the first one arrives, then
inserts everything gathered in one transaction; events that arrive while that transaction runs
wait for the next window. So under load a transaction carries about ``rate * flush_seconds``
events, whatever the database's speed: the cost of the writes per request falls as the load
rises, instead of the writer chasing each new event with a transaction of its own.

``GET /v1/usage`` and shutdown call :meth:`flush` first, which skips the window and returns once
every event submitted before the call is written, so a client that reads its usage right after
a response sees it. Inserts are keyed by request id (``ON CONFLICT DO NOTHING``), so a retried
request is counted once. A batch the database refuses is retried (with back-off), never
dropped while the process lives.
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
        flush_seconds: How long the writer gathers events after the first one arrives (the
            longest an event waits in memory, unless the database is slow or down).
        max_batch: Most events per transaction (a bigger backlog is written in several).

    Attributes:
        submitted: Events submitted so far.
        written: Events written so far (a prefix of those submitted: the queue is FIFO).
        transactions: Write transactions committed so far.
    """

    def __init__(
        self, sessions: async_sessionmaker, *, flush_seconds: float = 0.2, max_batch: int = 512
    ) -> None:
        self._sessions = sessions
        self._flush_seconds = flush_seconds
        self._max_batch = max_batch
        self._pending: list[UsageRecord] = []
        self.submitted = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.written = 0
        self.transactions = 0

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
        self.submitted += 1
        self._wake.set()

    @property
    def pending(self) -> int:
        """Events not yet written."""
        return len(self._pending)

    async def flush(self) -> None:
        """Wait until every event submitted before this call is written.

        Without a running writer task (not started, or closed) the events are written here.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: only without a writer task, when the write fails.
        """
        target = self.submitted
        if self.written >= target:
            return
        if self._task is None or self._task.done():
            await self._write(len(self._pending))
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, done))
        self._urgent.set()
        self._wake.set()
        await done

    async def close(self) -> None:
        """Write what is queued, then stop the task.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: the last write failed (the events are lost; flushes
                still waiting get a ``RuntimeError``).
        """
        self._closing = True
        self._urgent.set()
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=30)
            except TimeoutError:
                logger.error("usage writer did not finish; %d events unwritten", self.pending)
            self._task = None
        try:
            await self._write(len(self._pending))
        finally:  # nothing will write what is left: flushes still waiting fail
            for _, done in self._waiters:
                if not done.done():
                    done.set_exception(RuntimeError("the usage writer closed before writing"))
            self._waiters = []

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
            if self._pending:
                self._wake.set()
                if self._waiters:
                    self._urgent.set()

    async def _write(self, count: int) -> None:
        """Write the first ``count`` pending events, ``max_batch`` per transaction."""
        while count > 0:
            batch = self._pending[: min(count, self._max_batch)]
            async with self._sessions() as session, session.begin():
                await record_usage_batch(session, batch)
            del self._pending[: len(batch)]
            count -= len(batch)
            self.written += len(batch)
            self.transactions += 1
            self._release_waiters()

    def _release_waiters(self) -> None:
        """Resolve the flushes whose events are all written."""
        if not self._waiters:
            return
        still = []
        for target, done in self._waiters:
            if self.written >= target:
                if not done.done():
                    done.set_result(None)
            else:
                still.append((target, done))
        self._waiters = still
