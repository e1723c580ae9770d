"""The waiting queue, shared fairly between tenants by virtual token counters.

Virtual Token Counter (VTC; Sheng et al., "Fairness in Serving Large Language Models", OSDI
2024): every tenant has a counter of the service it has received, in weighted tokens
(``prompt_weight`` per prompt token computed, ``output_weight`` per token generated; the paper's
1 and 2). The next sequence admitted is the oldest waiting one of the tenant with the lowest
counter, so a tenant flooding the queue only ever competes with its own requests. A tenant that
becomes active again after being idle (nothing waiting, nothing running) has its counter lifted
to the lowest counter of the tenants active now: idle time banks no credit (the paper's rule),
so a returning tenant is served next but cannot then monopolise the engine.

Within a tenant, order is first come, first served, and a preempted sequence goes back to the
front of its tenant's queue. Without tenants (``tenant`` None everywhere) the queue is one FCFS
deque, as before.

Priority classes come before fairness: each request has a class (``EngineRequest.priority``,
interactive 0, batch 1; lower first), a tenant has one queue per class, and :meth:`peek` only
looks at a class when no lower one waits (outside ``skip``). The scheduler admits a batch
sequence only while no interactive one waits at all (:meth:`waits_before`), preempts batch
sequences first and leaves them out of a step that carries an interactive prefill
(``engine.scheduling.scheduler``), so batch work only gets the capacity interactive traffic
leaves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from loraplex.engine.sequence import Sequence

PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


def tenant_of(seq: Sequence) -> str:
    """The fairness group of a sequence (``""`` for requests without a tenant)."""
    return seq.request.tenant or ""


def priority_of(seq: Sequence) -> int:
    """The scheduling class of a sequence (0 interactive, 1 batch; lower goes first)."""
    return seq.request.priority


class FairQueue:
    """Waiting sequences per tenant; :meth:`peek` is the next to admit (VTC order).

    Args:
        prompt_weight: Counter units per prompt token computed.
        output_weight: Counter units per token generated.

    Attributes:
        counters: ``tenant -> service received`` in weighted tokens (only grows).
        running: ``tenant -> sequences running now`` (the scheduler reports them with
            :meth:`started` and :meth:`stopped`); a running tenant counts as active.
    """

    def __init__(
        self, prompt_weight: float = PROMPT_WEIGHT, output_weight: float = OUTPUT_WEIGHT
    ) -> None:
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}
        self.running: dict[str, int] = {}
        self._queues: dict[tuple[int, str], deque[Sequence]] = {}
        self._by_priority: dict[int, int] = {}
        self._len = 0

    # ------------------------------------------------------------------------- queue
    def append(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of its tenant's queue (of its class)."""
        self._queue(seq).append(seq)
        self._count(seq, 1)

    def appendleft(self, seq: Sequence) -> None:
        """Queue a preempted sequence at the front of its tenant's queue (of its class)."""
        self._queue(seq).appendleft(seq)
        self._count(seq, 1)

    def peek(self, skip: set[str] | frozenset[str] = frozenset()) -> Sequence | None:
        """The next sequence to admit: the lowest class, then the tenant with the lowest counter.

        Ties (a tenant lifted to the lowest counter ties with it) go to the tenant running
        fewer sequences, then to the oldest head.

        Args:
            skip: Tenants not to consider (their turn in this step is over).
        """
        best: Sequence | None = None
        best_key: tuple[int, float, int, float] | None = None
        for (priority, tenant), queue in self._queues.items():
            if tenant in skip:
                continue
            head = queue[0]
            key = (
                priority,
                self.counters.get(tenant, 0.0),
                self.running.get(tenant, 0),
                head.request.arrival_time,
            )
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def popleft(self) -> Sequence:
        """Remove and return :meth:`peek`.

        Raises:
            IndexError: the queue is empty.
        """
        seq = self.peek()
        if seq is None:
            raise IndexError("pop from an empty FairQueue")
        self.remove(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out wherever it waits.

        Raises:
            ValueError: it is not waiting.
        """
        key = (priority_of(seq), tenant_of(seq))
        queue = self._queues.get(key)
        if queue is None:
            raise ValueError("sequence is not waiting")
        queue.remove(seq)
        self._count(seq, -1)
        if not queue:
            del self._queues[key]

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self._queues.values():
            yield from queue

    def waiting_tenants(self) -> list[str]:
        """Tenants with at least one waiting sequence."""
        return list(dict.fromkeys(t for _, t in self._queues))

    def waits_before(self, priority: int) -> bool:
        """Whether a sequence of a class ahead of ``priority`` (a lower number) is waiting."""
        return any(n for p, n in self._by_priority.items() if p < priority)

    def waits_after(self, priority: int) -> bool:
        """Whether a sequence of a class behind ``priority`` (a higher number) is waiting."""
        return any(n for p, n in self._by_priority.items() if p > priority)

    def demand(
        self, limit: int, cost: Callable[[Sequence], float], priority: int | None = None
    ) -> dict[str, float]:
        """Each waiting tenant's work: ``cost`` over its first ``limit`` sequences per class.

        Args:
            limit: Sequences counted per (class, tenant) queue.
            cost: A waiting sequence's work.
            priority: Count only this class (None: every class).
        """
        work: dict[str, float] = {}
        for (p, t), q in self._queues.items():
            if priority is None or p == priority:
                work[t] = work.get(t, 0.0) + sum(cost(q[i]) for i in range(min(limit, len(q))))
        return work

    # ---------------------------------------------------------------------- counters
    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        """Add the service a tenant's sequences received in a step."""
        self.counters[tenant] = (
            self.counters.get(tenant, 0.0)
            + self.prompt_weight * prompt_tokens
            + self.output_weight * output_tokens
        )

    def started(self, seq: Sequence) -> None:
        """A sequence of this tenant began running."""
        tenant = tenant_of(seq)
        self.running[tenant] = self.running.get(tenant, 0) + 1

    def stopped(self, seq: Sequence) -> None:
        """A running sequence of this tenant stopped (finished or preempted)."""
        tenant = tenant_of(seq)
        left = self.running.get(tenant, 0) - 1
        if left > 0:
            self.running[tenant] = left
        else:
            self.running.pop(tenant, None)

    def counter(self, tenant: str) -> float:
        """The tenant's counter (0 for a tenant never served)."""
        return self.counters.get(tenant, 0.0)

    def _count(self, seq: Sequence, delta: int) -> None:
        priority = priority_of(seq)
        self._by_priority[priority] = self._by_priority.get(priority, 0) + delta
        self._len += delta

    def _queue(self, seq: Sequence) -> deque[Sequence]:
        tenant = tenant_of(seq)
        key = (priority_of(seq), tenant)
        queue = self._queues.get(key)
        if queue is None:
            waiting = {t for _, t in self._queues}
            if tenant not in self.running and tenant not in waiting:  # active again: no credit
                active = [t for t in (*waiting, *self.running) if t != tenant]
                if active:
                    floor = min(self.counters.get(t, 0.0) for t in active)
                    self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
            queue = self._queues[key] = deque()
        return queue
