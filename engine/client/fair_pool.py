"""A worker pool for CPU work on the request path, shared fairly between tenants.

Chat templating, tokenization and image decoding cost CPU in proportion to the input, and a
hostile tenant controls the input. On one shared worker (or a plain thread pool, first come
first served) one tenant's stream of expensive jobs queues every other tenant's jobs behind
it: head-of-line blocking across tenants. Here each tenant has its own queue, workers take
jobs from the tenants in round-robin order (one job per turn, as deficit round robin with equal
quanta; Shreedhar and Varghese 1995), and no tenant may hold more than ``workers - 1`` workers
at once, so with two or more workers one is always left for the others: a newcomer's job
starts as soon as a worker frees up, however many jobs are queued before it. The per-job
cost itself is bounded by the request checks that run before (text bytes, message and image
counts, image sizes), so that wait is bounded too.

Jobs run on threads: the work is in Rust (tokenizers) and C (Pillow's decoders, numpy)
for its larger part, which releases the GIL.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


class PoolBusyError(RuntimeError):
    """The tenant already has ``max_queued_per_tenant`` jobs waiting (a 429 for the caller)."""


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple
    future: asyncio.Future


def default_workers() -> int:
    """Workers for this machine: one per CPU this process may use, at least 2."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(2, cpus)


class FairWorkerPool:
    """Runs blocking jobs on threads, round-robin across tenants.

    Args:
        workers: Threads (>= 1). With 1, a tenant may hold it (nothing to reserve).
        max_queued_per_tenant: Most jobs one tenant may have waiting; more raise
            :class:`PoolBusyError`.
        name: Thread name prefix.

    Attributes:
        max_running_per_tenant: ``max(1, workers - 1)``.
    """

    def __init__(
        self, workers: int, *, max_queued_per_tenant: int = 64, name: str = "loraplex-inputs"
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.workers = workers
        self.max_running_per_tenant = max(1, workers - 1)
        self.max_queued_per_tenant = max_queued_per_tenant
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._queues: dict[str, deque[_Job]] = {}
        self._turns: deque[str] = deque()  # tenants with waiting jobs, in turn order
        self._running: dict[str, int] = {}
        self._busy = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, tenant: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on a worker when it is the tenant's turn; its result.

        A caller that is cancelled while its job waits takes the job off the queue; a job
        already running finishes and its result is dropped.

        Raises:
            PoolBusyError: the tenant has too many jobs waiting.
            Exception: whatever ``fn`` raises.
        """
        self._loop = asyncio.get_running_loop()
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
        if len(queue) >= self.max_queued_per_tenant:
            raise PoolBusyError(f"{len(queue)} jobs of this tenant are already waiting")
        job = _Job(fn, args, self._loop.create_future())
        if not queue:
            self._turns.append(tenant)
        queue.append(job)
        self._dispatch()
        try:
            return await job.future
        except asyncio.CancelledError:
            waiting = self._queues.get(tenant)
            if waiting is not None and job in waiting:  # not started: leave no trace
                waiting.remove(job)
            raise

    @property
    def waiting(self) -> int:
        """Jobs waiting for a worker."""
        return sum(len(q) for q in self._queues.values())

    def running_of(self, tenant: str) -> int:
        """Jobs of ``tenant`` on a worker now."""
        return self._running.get(tenant, 0)

    def _dispatch(self) -> None:
        """Start waiting jobs on free workers, one per tenant per turn."""
        skipped: list[str] = []
        while self._busy < self.workers and self._turns:
            tenant = self._turns.popleft()
            queue = self._queues[tenant]
            while queue and queue[0].future.done():  # cancelled while waiting
                queue.popleft()
            if not queue:
                del self._queues[tenant]
                continue
            if self._running.get(tenant, 0) >= self.max_running_per_tenant:
                skipped.append(tenant)  # at its cap: keeps its place for the next round
                continue
            self._start(tenant, queue.popleft())
            if queue:
                self._turns.append(tenant)
            else:
                del self._queues[tenant]
        self._turns.extendleft(reversed(skipped))

    def _start(self, tenant: str, job: _Job) -> None:
        self._busy += 1
        self._running[tenant] = self._running.get(tenant, 0) + 1
        work = self._executor.submit(job.fn, *job.args)
        loop = self._loop
        assert loop is not None
        work.add_done_callback(
            lambda done: loop.call_soon_threadsafe(self._finished, tenant, job, done)
        )

    def _finished(self, tenant: str, job: _Job, done: Future) -> None:
        self._busy -= 1
        left = self._running[tenant] - 1
        if left:
            self._running[tenant] = left
        else:
            del self._running[tenant]
        if not job.future.done():
            error = done.exception()
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(done.result())
        self._dispatch()

    def shutdown(self) -> None:
        """Stop the threads; waiting jobs are dropped (their callers cancelled)."""
        for queue in self._queues.values():
            for job in queue:
                job.future.cancel()
        self._queues.clear()
        self._turns.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
