"""The scheduler's preemption: fairness between tenants, recompute and swap, swap-in.

A mixin of :class:`engine.scheduler.Scheduler` (see its module docstring, steps 0 and 1, for
the policy), split out to keep files single-purpose.
"""

from __future__ import annotations

from loraplex.engine.fair_queue import tenant_of
from loraplex.engine.kv_cache import SlotAllocation
from loraplex.engine.scheduler_output import (
    SchedulerOutput,
)
from loraplex.engine.scheduler_update import core_output
from loraplex.engine.sequence import Sequence, SequenceStatus


class Preemption:
    """Preemption and swap-in (mixed into ``Scheduler``)."""

    def _preempt_for_fairness(self, out: SchedulerOutput) -> None:
        """Preempt one running sequence of an over-served tenant if the fair head is blocked.

        See step 0 of the module docstring. The victim is the newest running sequence of the
        tenant that runs the most sequences above its share, among those whose counter is
        higher than the head's tenant's; with ``recompute`` its computed blocks stay cached,
        so resuming it is mostly prefix hits.
        """
        head = self.waiting.peek()
        if head is None or not self.running:
            return
        if len(self.running) < self.max_num_seqs and self._fits(head):
            return
        fair = self.waiting
        tenant = tenant_of(head)
        counts = fair.running
        share = -(-self.max_num_seqs // len(set(counts) | {tenant}))  # ceil: no ping-pong
        floor = fair.counter(tenant)
        over = [
            t for t, n in counts.items() if t != tenant and n > share and fair.counter(t) > floor
        ]
        if not over:
            return
        victim_tenant = max(over, key=lambda t: (counts[t], fair.counter(t)))
        victim = next(s for s in reversed(self.running) if tenant_of(s) == victim_tenant)
        self.running.remove(victim)
        fair.stopped(victim)
        self._preempt(victim, out)

    def _allocate_or_preempt(
        self, seq: Sequence, num_new: int, out: SchedulerOutput
    ) -> SlotAllocation | None:
        """Allocate for a running sequence, preempting the newest ones until it fits."""
        while True:
            alloc = self.kv.allocate_slots(
                seq.seq_id,
                num_new,
                num_computed_tokens=seq.num_computed_tokens,
                block_hashes=seq.hasher.block_hashes,
            )
            if alloc is not None:
                return alloc
            if self.running[-1] is seq and len(self.running) == 1:
                # Alone and still no room: every other block is free or evictable, so the
                # pool can never hold this sequence's next token. Preempting it would only
                # re-admit it forever (a livelock at 100% CPU); it ends here instead.
                self.finish(seq, "length")
                out.capped.append(seq.seq_id)
                self._pending.append(core_output(seq, [], None, "length"))
                return None
            victim = self.running.pop()
            self.waiting.stopped(victim)
            self._preempt(victim, out)
            if victim is seq:
                return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput, allow_swap: bool = True) -> None:
        """Move a running sequence back to the front of the waiting queue."""
        self.num_preemptions += 1
        out.preempted.append(seq.seq_id)
        self._release_lora(seq)
        swapped = False
        if (
            allow_swap
            and self.preemption == "swap"
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
        seq.spec_token_ids = []
        seq.swapped = swapped
        if not swapped:
            seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        if seq.known_to_runner:
            seq.known_to_runner = False
            self._dropped.append(seq.seq_id)
        self.waiting.appendleft(seq)

    def _swap_in(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        """Admit a swapped sequence: fresh device blocks, KV copied back from the CPU pool."""
        restored = seq.num_computed_tokens
        num_new = min(seq.num_tokens - restored, budget)
        alloc = self.kv.allocate_slots(
            seq.seq_id, restored + num_new, block_hashes=seq.hasher.block_hashes
        )
        if alloc is None:
            return False
        cpu_blocks = self.swap_tables.pop(seq.seq_id)
        out.swap_in.extend(zip(cpu_blocks, alloc.new_block_ids, strict=False))
        self.cpu_pool.free(cpu_blocks)  # the copy happens before anything reuses them
        seq.swapped = False
        self._record(out, seq, restored, num_new, SlotAllocation())
        return True
