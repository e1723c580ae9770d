"""The batch runner: runs each batch's lines through the endpoints' own path, in the gateway.

Life of a batch (OpenAI's statuses; its row in ``batches`` is the state, so a restarted
gateway picks every unfinished batch up again with :meth:`BatchRunner.resume`). A runner runs
a batch only while it holds the batch's lease (``gateway.domains.batches.lease``), so several
gateways on one database never run the same batch, and a crashed one's batches are taken over
when their leases expire::

    validating  --lines checked (gateway.domains.batches.lines)--> failed (errors) | in_progress
    in_progress --every line answered-----------------------------> finalizing -> completed
                --cancel (POST /v1/batches/{id}/cancel)-----------> cancelling -> cancelled
                --expires_at (24 h) passed: lines in flight aborted---> finalizing -> expired

Each line runs through :func:`gateway.domains.chat.controller.run_line`: the endpoint's own
parser, model resolution, prompt processing, engine run (at ``PRIORITY_BATCH``: the engine
admits it only while no interactive request waits, and preempts it first), response body and
usage row (with the batch's id in ``batch_id``). At most ``batch_concurrency`` lines of a batch
are in flight, and ``batch_max_running`` batches run at once, their slots shared across tenants
(``gateway.domains.batches.slots``: a tenant with a batch running does not start another while
another tenant's batch waits). Each answer is appended to the
batch's progress file (``gateway.domains.batches.progress``) as it arrives, so after a restart
only the lines not answered run. A cancel aborts the lines in flight (their usage rows say
``aborted``) and finalizes with what was answered. A server shutdown aborts the lines in flight
and leaves the batch ``in_progress`` for the next start.

Finalizing writes the answers, in input order, as the output file (HTTP 200 lines) and the
error file (the others), both ``purpose: batch_output`` files of the tenant, recorded with the
batch's final status in one transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.gateway.auth.principals import TenantPrincipal
from loraplex.gateway.db.models import Batch, StoredFile
from loraplex.gateway.db.types import utcnow
from loraplex.gateway.domains.batches.lease import (
    ACTIVE,
    claim,
    claimable,
    new_owner_id,
    release,
    renew,
)
from loraplex.gateway.domains.batches.lines import Line, iter_raw, parse_line, read_lines, validate
from loraplex.gateway.domains.batches.progress import ProgressLog, progress_path, read_progress
from loraplex.gateway.domains.batches.slots import TenantSlots
from loraplex.gateway.domains.chat.controller import run_line
from loraplex.gateway.domains.chat.service import ChatDeps
from loraplex.gateway.domains.files.store import file_path, files_root, new_file_id
from loraplex.gateway.server.config import GatewayConfig
from loraplex.gateway.services.tenants import TenantLimits

logger = logging.getLogger(__name__)

COMPLETION_WINDOW = timedelta(hours=24)
READ_CHUNK = 256
"""Lines read from the input file per worker-thread call."""
UNAVAILABLE_RETRIES = 30
"""Times a line answered 503 (engine restarting, usage database down) is run again before its
503 goes to the error file; each try has its own usage row."""
UNAVAILABLE_WAIT_S = 1.0
COUNTS_EVERY_S = 1.0
"""How often ``request_counts`` are written to the database while a batch runs."""


@dataclass
class _Running:
    """A batch this runner is executing: its cancel flag and its lines in flight."""

    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    lines: set[asyncio.Task] = field(default_factory=set)


class BatchRunner:
    """Runs the batches of every tenant, resuming unfinished ones at start.

    Args:
        sessions: The database.
        config: ``files_dir``, ``batch_concurrency``, ``batch_max_running``.
        deps: The generation dependencies, read when a line starts (``ChatDeps``).
    """

    def __init__(
        self,
        sessions: async_sessionmaker,
        config: GatewayConfig,
        deps: Callable[[], ChatDeps],
    ) -> None:
        self.sessions = sessions
        self.config = config
        self.deps = deps
        self.tasks: dict[str, asyncio.Task] = {}
        self._running: dict[str, _Running] = {}
        self._slots = TenantSlots(config.batch_max_running)
        self.owner = new_owner_id()
        self.lease_s = config.batch_lease_seconds
        self._sweeper: asyncio.Task | None = None

    # ------------------------------------------------------------------ control
    async def resume(self) -> list[str]:
        """Launch every unfinished batch no live lease holds (a restart, a crashed peer).

        Returns:
            Their ids (those this runner already runs included; they are not launched twice).
        """
        ids = await claimable(self.sessions)
        for batch_id in ids:
            self.launch(batch_id)
        return ids

    async def start(self) -> None:
        """Resume what is left unfinished, then sweep for claimable batches every half lease."""
        await self.resume()
        self._sweeper = asyncio.create_task(self._sweep(), name="loraplex-batch-sweep")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 2)
            try:
                await self.resume()
            except Exception:  # the database is down: the next sweep tries again
                logger.warning("batch sweep failed", exc_info=True)

    def launch(self, batch_id: str) -> None:
        """Run the batch in a task of its own (nothing if it already runs here)."""
        if batch_id in self.tasks:
            return
        task = asyncio.create_task(self._run(batch_id), name=f"loraplex-{batch_id}")
        self.tasks[batch_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(batch_id, None))

    def cancel(self, batch_id: str) -> None:
        """Stop launching the batch's lines and abort those in flight (its row says so)."""
        running = self._running.get(batch_id)
        if running is not None:
            running.cancelled.set()
            for task in list(running.lines):
                task.cancel()

    async def close(self) -> None:
        """Stop every batch (server shutdown); the next start resumes them.

        Lines in flight are aborted; rows are left as they are.
        """
        tasks = list(self.tasks.values())
        if self._sweeper is not None:
            self._sweeper.cancel()
            tasks.append(self._sweeper)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    # ------------------------------------------------------------------ one batch
    async def _run(self, batch_id: str) -> None:
        try:
            row = await self._load(batch_id)
            if row is None or row.status not in ACTIVE:
                return
            tenant = row.tenant_id
            await self._slots.acquire(tenant)  # fair across tenants (batches.slots)
            try:
                if await claim(self.sessions, batch_id, self.owner, self.lease_s):
                    await self._held(batch_id)  # else another gateway holds its lease
            finally:
                self._slots.release(tenant)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("batch %s failed in the runner", batch_id)
            with contextlib.suppress(Exception):
                await self._set(
                    batch_id,
                    status="failed",
                    failed_at=utcnow(),
                    errors=[{"code": "internal_error", "message": "the batch runner failed"}],
                )

    async def _held(self, batch_id: str) -> None:
        """Run the batch while renewing its lease; stop if the lease is lost; then release it."""
        step = asyncio.create_task(self._step(batch_id), name=f"loraplex-{batch_id}-step")
        lost = asyncio.Event()
        keeper = asyncio.create_task(self._keep(batch_id, step, lost))
        try:
            await step
        except asyncio.CancelledError:
            if not lost.is_set():
                raise  # the gateway stopping
            logger.warning("batch %s: lease lost, stopped here", batch_id)
        finally:
            keeper.cancel()
            with contextlib.suppress(Exception):
                await asyncio.shield(release(self.sessions, batch_id, self.owner))

    async def _keep(self, batch_id: str, step: asyncio.Task, lost: asyncio.Event) -> None:
        """Renew the lease every third of it; cancel ``step`` when it is no longer ours.

        A cancel made on another gateway (status ``cancelling``) is seen here too.
        """
        last_ok = time.monotonic()
        while not step.done():
            await asyncio.sleep(self.lease_s / 3)
            try:
                status = await asyncio.wait_for(
                    renew(self.sessions, batch_id, self.owner, self.lease_s), self.lease_s / 3
                )
            except Exception:
                logger.warning("batch %s: lease renewal failed", batch_id, exc_info=True)
                if time.monotonic() - last_ok < self.lease_s * 2 / 3:
                    continue
                status = None  # stop before the lease can have run out
            if status is None:
                lost.set()
                step.cancel()
                return
            last_ok = time.monotonic()
            if status == "cancelling":
                self.cancel(batch_id)

    async def _step(self, batch_id: str) -> None:
        """Take the batch from its current status to a final one (holding a running slot)."""
        row = await self._load(batch_id)
        if row is not None and row.status == "validating":
            row = await self._validate(row)
        if row is not None and row.status == "in_progress":
            ending = await self._execute(row)
            row = await self._load(batch_id)
            if row is not None and row.status == "in_progress":
                await self._finalize(row, ending)
                return
        if row is not None and row.status in ("finalizing", "cancelling"):
            await self._finalize(row, "cancelled" if row.status == "cancelling" else "completed")

    async def _load(self, batch_id: str) -> Batch | None:
        async with self.sessions() as session:
            return await session.get(Batch, batch_id)

    async def _set(self, batch_id: str, when: tuple[str, ...] = (), **values: Any) -> bool:
        """Update the row (only while its status is one of ``when``, if given)."""
        stmt = update(Batch).where(Batch.id == batch_id).values(**values)
        if when:
            stmt = stmt.where(Batch.status.in_(when))
        async with self.sessions() as session:
            result = await session.execute(stmt)
            await session.commit()
        return result.rowcount == 1

    async def _validate(self, row: Batch) -> Batch | None:
        path = file_path(self.config.files_dir, row.input_file_id)
        try:
            total, errors = await asyncio.to_thread(validate, path, row.endpoint)
        except FileNotFoundError:
            total, errors = 0, [{"code": "file_not_found", "message": "the input file is gone"}]
        if errors:
            await self._set(
                row.id,
                ("validating",),
                status="failed",
                failed_at=utcnow(),
                errors=errors,
                total=total,
            )
        else:
            await self._set(
                row.id, ("validating",), status="in_progress", in_progress_at=utcnow(), total=total
            )
        return await self._load(row.id)

    async def _execute(self, row: Batch) -> str:
        """Answer the lines not answered yet; returns the ending: completed/cancelled/expired."""
        running = self._running[row.id] = _Running()  # before any wait: a cancel finds it
        files_dir = files_root(self.config.files_dir)
        ppath = progress_path(files_dir, row.id)
        done = await asyncio.to_thread(read_progress, ppath)
        counts = {
            "completed": sum(1 for ok, _ in done.values() if ok),
            "failed": sum(1 for ok, _ in done.values() if not ok),
        }
        principal = TenantPrincipal(row.tenant_id, "", row.key_id or "", TenantLimits())
        slots = asyncio.Semaphore(max(1, self.config.batch_concurrency))
        log = await asyncio.to_thread(ProgressLog, ppath)
        appends: set[asyncio.Future] = set()
        last_save = [time.monotonic()]
        lines = read_lines(
            file_path(self.config.files_dir, row.input_file_id), row.endpoint, set(done)
        )
        expired = asyncio.Event()

        def expire() -> None:  # the completion window ended: unfinished lines are cancelled
            expired.set()
            for task in list(running.lines):
                task.cancel()  # aborted in the engine; its usage row says so

        left_s = (row.expires_at - utcnow()).total_seconds() if row.expires_at else None
        timer = (
            None
            if left_s is None
            else asyncio.get_running_loop().call_later(max(0.0, left_s), expire)
        )

        async def one(line: Line) -> None:
            for attempt in range(UNAVAILABLE_RETRIES + 1):
                status, request_id, body = await run_line(
                    self.deps(), principal, row.endpoint, line.body, row.id
                )
                if status != 503 or attempt == UNAVAILABLE_RETRIES:
                    break
                await asyncio.sleep(UNAVAILABLE_WAIT_S)  # the engine or database: not the line
            record = {
                "id": f"batch_req_{secrets.token_hex(16)}",
                "custom_id": line.custom_id,
                "response": {"status_code": status, "request_id": request_id, "body": body},
                "error": None,
            }
            # fsynced in a worker thread; a cancel now must not lose an answered (billed) line
            write = asyncio.ensure_future(
                asyncio.to_thread(log.append, line.index, status == 200, record)
            )
            appends.add(write)
            write.add_done_callback(appends.discard)
            await asyncio.shield(write)
            counts["completed" if status == 200 else "failed"] += 1
            if time.monotonic() - last_save[0] >= COUNTS_EVERY_S:
                last_save[0] = time.monotonic()
                await self._set(row.id, **counts)

        try:
            while True:
                chunk = await asyncio.to_thread(lambda: list(itertools.islice(lines, READ_CHUNK)))
                if not chunk:
                    break
                for line in chunk:
                    await slots.acquire()
                    if running.cancelled.is_set():
                        slots.release()
                        break
                    if expired.is_set() or (row.expires_at and utcnow() >= row.expires_at):
                        slots.release()
                        expired.set()
                        break
                    task = asyncio.create_task(one(line))
                    running.lines.add(task)
                    task.add_done_callback(running.lines.discard)
                    task.add_done_callback(lambda _: slots.release())  # even if never started
                if running.cancelled.is_set() or expired.is_set():
                    break
            if running.lines:
                await asyncio.wait(set(running.lines))
        except asyncio.CancelledError:  # server shutdown: abort the lines, leave the row
            for task in list(running.lines):
                task.cancel()
            if running.lines:
                await asyncio.wait(set(running.lines), timeout=10)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._running.pop(row.id, None)
            lines.close()
            if appends:  # answers being written when the lines were cancelled
                await asyncio.shield(asyncio.wait(set(appends)))
            log.close()
            with contextlib.suppress(Exception):
                await asyncio.shield(self._set(row.id, **counts))
        if running.cancelled.is_set():
            return "cancelled"
        return "expired" if expired.is_set() else "completed"

    async def _finalize(self, row: Batch, ending: str) -> None:
        """Write the output and error files and the final status, in one transaction."""
        now = utcnow()
        if ending == "completed" or ending == "expired":
            await self._set(
                row.id,
                ("in_progress", "finalizing"),
                status="finalizing",
                finalizing_at=row.finalizing_at or now,
            )
        files_dir = files_root(self.config.files_dir)
        ppath = progress_path(files_dir, row.id)
        written = await asyncio.to_thread(
            _write_results, files_dir, ppath, row, ending == "expired"
        )
        final = {"completed": "completed", "expired": "expired", "cancelled": "cancelled"}[ending]
        async with self.sessions() as session:
            current = await session.get(Batch, row.id)
            if current is None or current.status not in ACTIVE:
                _discard(written)
                return
            if ending == "completed" and current.status == "cancelling":
                final = "cancelled"
            for kind, (temp, size, lines) in written.items():
                if temp is None:
                    continue
                file_id = new_file_id()
                os.replace(temp, file_path(files_dir, file_id))
                session.add(
                    StoredFile(
                        id=file_id,
                        tenant_id=row.tenant_id,
                        purpose="batch_output",
                        filename=f"{row.id}_{kind}.jsonl",
                        bytes=size,
                        lines=lines,
                        created_at=now,
                    )
                )
                setattr(current, f"{kind}_file_id", file_id)
            current.completed = written["output"][2]
            current.failed = written["error"][2]
            current.status = final
            setattr(current, f"{final}_at", now)
            await session.commit()
        with contextlib.suppress(FileNotFoundError):
            ppath.unlink()


def _write_results(
    files_dir: Path, ppath: Path, row: Batch, expired: bool
) -> dict[str, tuple[Path | None, int, int]]:
    """Write the output and error files from the progress file (blocking).

    Returns:
        ``{"output" | "error": (temporary path or None when empty, bytes, lines)}``.
    """
    done = read_progress(ppath)
    if expired:  # the lines never run: each an error, as OpenAI reports an expired request
        path = file_path(files_dir, row.input_file_id)
        with contextlib.suppress(FileNotFoundError):
            for index, (number, raw) in enumerate(iter_raw(path)):
                if index not in done:
                    line, _ = parse_line(raw, number, index, row.endpoint)
                    done[index] = (
                        False,
                        {
                            "id": f"batch_req_{secrets.token_hex(16)}",
                            "custom_id": line.custom_id if line else None,
                            "response": None,
                            "error": {
                                "code": "batch_expired",
                                "message": "The request could not be executed before the "
                                "completion window ended.",
                            },
                        },
                    )
    out: dict[str, tuple[Path | None, int, int]] = {}
    for kind, want in (("output", True), ("error", False)):
        records = [done[i][1] for i in sorted(done) if done[i][0] is want]
        if not records:
            out[kind] = (None, 0, 0)
            continue
        with tempfile.NamedTemporaryFile(dir=files_dir, prefix=".result-", delete=False) as h:
            for record in records:
                h.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
            out[kind] = (Path(h.name), h.tell(), len(records))
    return out


def _discard(written: dict[str, tuple[Path | None, int, int]]) -> None:
    for temp, _, _ in written.values():
        if temp is not None:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()


def expires_at_for(created) -> Any:
    """When a batch created at ``created`` expires (``completion_window``: 24 h)."""
    return created + COMPLETION_WINDOW
