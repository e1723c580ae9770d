"""A gateway's running-batch slots, shared across tenants round-robin.

At most ``capacity`` batches run at once in a gateway (``batch_max_running``). A plain
semaphore hands freed slots out first come, first served, so one tenant that queued four
batches holds all four slots and every other tenant's batch waits behind them. Here each
tenant queues its own batches, and a freed slot goes to the waiting tenant that has the fewest
running batches, ties broken by who was served longest ago (round-robin, the same rule as the
engine's per-tenant fair queue, docs/engine.md). So a tenant with a batch running does not
start another while another tenant's batch waits; a running batch is never stopped for a
newcomer.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, deque


class TenantSlots:
    """``capacity`` slots, granted per tenant: fewest running first, then round-robin.

    Args:
        capacity: How many holders at once (>= 1).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.running: Counter[str] = Counter()
        self._waiting: dict[str, deque[asyncio.Future]] = {}
        self._served: dict[str, int] = {}
        self._turn = itertools.count()

    def waiting(self, tenant: str | None = None) -> int:
        """Holders queued (of ``tenant``, or of all)."""
        queues = [self._waiting.get(tenant, ())] if tenant else self._waiting.values()
        return sum(sum(not f.done() for f in q) for q in queues)

    async def acquire(self, tenant: str) -> None:
        """Wait for a slot for one of ``tenant``'s batches (FIFO within the tenant).

        Raises:
            asyncio.CancelledError: Cancelled while waiting (no slot is held then).
        """
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(future)
        self._grant()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted as it was cancelled
                self.release(tenant)
            raise

    def release(self, tenant: str) -> None:
        """Give back one of ``tenant``'s slots and grant it to the next waiter."""
        self.running[tenant] -= 1
        if self.running[tenant] <= 0:
            del self.running[tenant]
        self._grant()

    def _grant(self) -> None:
        while sum(self.running.values()) < self.capacity:
            for tenant in list(self._waiting):
                queue = self._waiting[tenant]
                while queue and queue[0].done():  # cancelled while waiting
                    queue.popleft()
                if not queue:
                    del self._waiting[tenant]
            if not self._waiting:
                return
            tenant = min(self._waiting, key=lambda t: (self.running[t], self._served.get(t, -1)))
            self.running[tenant] += 1
            self._served[tenant] = next(self._turn)
            self._waiting[tenant].popleft().set_result(None)
