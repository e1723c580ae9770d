"""The scheduler's preemptor: which running sequence gives way, and where its KV goes.

A member of :class:`~loraplex.engine.scheduling.scheduler.Scheduler` (vLLM v1's scheduler
preempts inline; here the policy and the block movements are one object the scheduler owns).
The scheduler's module docstring, steps 0 and 1, has the policy:

- fairness (step 0): when the fair head of the waiting queue is blocked, the newest running
  sequence of the tenant that runs the most sequences above its share (and was served more
  than the head's tenant) gives way (:meth:`Preemptor.fairness_victim`);
- room (step 1): the newest running sequence gives way until the sequence being scheduled fits
  (:meth:`Preemptor.room_victim`);
- priority classes (``engine.scheduling.fair_queue``): a batch sequence gives way before any
  interactive one, in both cases, and a blocked interactive head preempts the newest running
  batch sequence whatever the tenants' shares; an interactive head blocked on an adapter slot
  preempts the batch sequences holding one (:meth:`Preemptor.slot_victims`), so batch lines
  that hold every slot cannot keep an interactive request waiting;
- ``recompute`` frees a victim's blocks (they stay cached, so resuming is mostly prefix hits);
  ``swap`` first copies its computed KV to the CPU pool (recompute when the pool is full), and
  :meth:`Preemptor.swap_in` copies it back at re-admission.

The preemptor moves blocks (device pool, CPU pool) and counts; it does not touch the
scheduler's queues or a sequence's fields: the scheduler's ``_preempt`` is the one transition
to ``PREEMPTED`` and applies what :meth:`Preemptor.evict` reports.
"""

from __future__ import annotations

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.kv_cache.swap import CpuBlockPool
from loraplex.engine.scheduling.fair_queue import FairQueue, priority_of, tenant_of
from loraplex.engine.scheduling.output import SchedulerOutput
from loraplex.engine.sequence import Sequence

POLICIES = ("recompute", "swap")
"""Preemption policies."""


class Preemptor:
    """Victim choice and the KV side of preemption (recompute, swap-out, swap-in).

    Args:
        kv: The KV cache manager (device blocks).
        policy: ``"recompute"`` or ``"swap"``.
        cpu_pool: The CPU block pool for ``"swap"`` (None: every preemption recomputes).

    Attributes:
        swap_tables: ``seq_id -> CPU block ids`` of each swapped-out sequence, in logical order.
        num_preemptions: Preemptions so far.
        num_swapped_out: Of them, those whose KV went to the CPU pool.

    Raises:
        ValueError: an unknown policy.
    """

    def __init__(
        self, kv: KVCacheManager, *, policy: str = "recompute", cpu_pool: CpuBlockPool | None
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown preemption policy {policy!r}")
        self.kv = kv
        self.policy = policy
        self.cpu_pool = cpu_pool
        self.swap_tables: dict[str, list[int]] = {}
        self.num_preemptions = 0
        self.num_swapped_out = 0

    # -------------------------------------------------------------------------- victims
    @staticmethod
    def fairness_victim(
        head: Sequence, running: list[Sequence], fair: FairQueue, max_num_seqs: int
    ) -> Sequence | None:
        """The running sequence that gives way to a blocked fair head (step 0), if any.

        Call it only when ``head`` cannot start (every slot taken, or the pool cannot hold
        its first chunk). A tenant's share is ``max_num_seqs`` over the tenants with work,
        rounded up, so shares that cannot be even never swap slots back and forth.

        Args:
            head: The waiting sequence due next.
            running: The running sequences, oldest first.
            fair: The waiting queue (its per-tenant counters and running counts).
            max_num_seqs: Most sequences running at once.

        Returns:
            The newest running sequence of the lowest class below the head's, if any runs;
            else the newest running sequence of the tenant most above its share among those
            served more than the head's tenant; None when no tenant qualifies.
        """
        below = [s for s in running if priority_of(s) > priority_of(head)]
        if below:  # a lower class gives way first: its newest sequence of the lowest class
            return max(reversed(below), key=priority_of)
        tenant = tenant_of(head)
        counts = fair.running
        share = -(-max_num_seqs // len(set(counts) | {tenant}))  # ceil: no ping-pong
        floor = fair.counter(tenant)
        over = [
            t for t, n in counts.items() if t != tenant and n > share and fair.counter(t) > floor
        ]
        if not over:
            return None
        victim_tenant = max(over, key=lambda t: (counts[t], fair.counter(t)))
        rank = priority_of(head)  # a batch head never preempts an interactive sequence
        return next(
            (
                s
                for s in reversed(running)
                if tenant_of(s) == victim_tenant and priority_of(s) >= rank
            ),
            None,
        )

    @staticmethod
    def room_victim(running: list[Sequence]) -> Sequence:
        """The sequence that gives way when the pool is short (step 1).

        The newest running sequence of the lowest class (batch before interactive).
        """
        return max(reversed(running), key=priority_of)

    @staticmethod
    def slot_victims(running: list[Sequence]) -> list[Sequence]:
        """The batch sequences that give way so an interactive head gets an adapter slot.

        Call it only when every adapter slot is held by running sequences. A slot is freed
        only when every sequence holding it stops, so the victims are all the running
        sequences of one adapter that no interactive sequence uses: the adapter with the
        fewest of them (the least work to recompute), the newest on a tie.

        Args:
            running: The running sequences, oldest first.

        Returns:
            The victims, newest first; empty when every held adapter has an interactive user.
        """
        users: dict[str, list[Sequence]] = {}
        for s in running:
            if s.request.lora_digest is not None:
                users.setdefault(s.request.lora_digest, []).append(s)
        batch_only = [seqs for seqs in users.values() if all(priority_of(s) > 0 for s in seqs)]
        if not batch_only:
            return []
        newest = {id(s): i for i, s in enumerate(running)}
        chosen = min(batch_only, key=lambda seqs: (len(seqs), -newest[id(seqs[-1])]))
        return chosen[::-1]

    # ------------------------------------------------------------------------ KV moves
    def evict(self, seq: Sequence, out: SchedulerOutput, *, allow_swap: bool = True) -> bool:
        """Release a preempted sequence's device blocks, swapping its KV out first if allowed.

        Records the preemption in ``out.preempted`` (and the copies in ``out.swap_out``).

        Args:
            seq: The victim (still holding its blocks).
            out: The step being scheduled.
            allow_swap: False to recompute whatever the policy (its step's KV is suspect).

        Returns:
            True when its computed KV went to the CPU pool (it resumes from
            ``num_computed_tokens``); False when it will be recomputed from scratch.
        """
        self.num_preemptions += 1
        out.preempted.append(seq.seq_id)
        swapped = False
        if (
            allow_swap
            and self.policy == "swap"
            and self.cpu_pool is not None
            and seq.num_computed_tokens
        ):
            bs = self.kv.block_size
            device_blocks = self.kv.get_block_ids(seq.seq_id)[: -(-seq.num_computed_tokens // bs)]
            cpu_blocks = self.cpu_pool.allocate(len(device_blocks))
            if cpu_blocks is not None:
                out.swap_out.extend(zip(device_blocks, cpu_blocks, strict=True))
                self.swap_tables[seq.seq_id] = cpu_blocks
                self.num_swapped_out += 1
                swapped = True
        self.kv.free(seq.seq_id)
        return swapped

    def swap_in(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Give a swapped sequence fresh device blocks and copy its KV back (``out.swap_in``).

        Args:
            seq: A swapped-out sequence (``num_computed_tokens`` of KV in the CPU pool).
            num_new: Tokens it computes in this step after the restored ones.
            out: The step being scheduled.

        Returns:
            False when the device pool cannot hold it (nothing changed).
        """
        restored = seq.num_computed_tokens
        alloc = self.kv.allocate_slots(
            seq.seq_id, restored + num_new, block_hashes=seq.hasher.block_hashes
        )
        if alloc is None:
            return False
        cpu_blocks = self.swap_tables.pop(seq.seq_id)
        out.swap_in.extend(zip(cpu_blocks, alloc.new_block_ids, strict=False))
        self.cpu_pool.free(cpu_blocks)  # the copy happens before anything reuses them
        return True

    def forget(self, seq_id: str) -> None:
        """A finished sequence: give back the CPU blocks it held while swapped out."""
        cpu_blocks = self.swap_tables.pop(seq_id, None)
        if cpu_blocks and self.cpu_pool is not None:
            self.cpu_pool.free(cpu_blocks)
