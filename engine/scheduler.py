"""The scheduler: continuous batching with a token budget, chunked prefill and preemption.

Each step (vLLM v1's unified scheduling; Orca's iteration-level batching):

0. Fairness between tenants: if the sequence due next (see 2) cannot start because every
   ``max_num_seqs`` slot is taken or the pool cannot hold its prompt, and another tenant runs
   more than its share of the slots (``max_num_seqs`` / tenants with work, rounded up, so
   shares that cannot be even never swap slots back and forth) with a higher virtual token
   counter, that tenant's newest running sequence is preempted (one per step) and the head is
   admitted in the same step, so a tenant holding the whole batch cannot make another wait
   for its streams to end.
1. Running sequences, oldest first, each get the tokens they still need (one for a decode, the
   rest of the prompt for a prefill), within the step's token budget. When the pool cannot fit
   them, the newest running sequence is preempted (``recompute``: its blocks are freed, they stay
   cached; ``swap``: its KV is copied to the CPU pool first) until it fits or the sequence
   itself was the one preempted.
2. If nothing was preempted in 1, waiting sequences are admitted in virtual-token-counter order
   (``engine.fair_queue``: the oldest waiting sequence of the tenant that has received the least
   service; first come, first served within a tenant and when there are no tenants): prefix
   lookup, then room for as much of the rest as the budget allows (chunked prefill). The first
   one that does not fit stops admission (no overtaking), as does ``max_num_seqs``, and a
   sequence whose adapter cannot get a device slot (every slot held by running sequences).
   Admission takes a reference on the adapter's slot, finishing or preemption drops it, so
   the running sequences, and so every step, never hold more distinct adapters than slots;
   and since nothing overtakes, requests waiting for a slot are served in that order across
   adapters (no starvation).
   Prefill tokens are shared between tenants within each step: while some sequence decodes,
   the step carries at most ``long_prefill_token_threshold`` prefill tokens (Sarathi-Serve's
   stall-free batching: another tenant's 4,000-token prompt cannot stretch every decoder's
   step), and a step's prefill tokens are split max-min fairly between the tenants that want
   some, so a newcomer's short prompt is computed in the step it is admitted.
3. The step's sequences are put in batch order grouped by adapter (a stable sort, base model
   first), so every adapter's tokens form one contiguous segment of the flattened batch:
   Punica's SGMV layout, where each segment's LoRA shrink/expand works on a view of the
   activations in place, with no gather or scatter. Each tenant's counter is charged with the
   step's tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.fair_queue import FairQueue, tenant_of
from loraplex.engine.kv_cache import KVCacheManager, SlotAllocation
from loraplex.engine.request import Sequence, SequenceStatus
from loraplex.engine.swap import CpuBlockPool


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step.

    Attributes:
        seq: The sequence.
        start: Its ``num_computed_tokens`` before the step: the first position computed.
        num_new_tokens: Tokens computed this step, positions ``[start, start + num_new_tokens)``.
        sample: Whether the step ends at the sequence's last token, so a token is sampled.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    """What one step runs.

    Attributes:
        scheduled: Sequences in the step, in batch order.
        block_copies: Copy-on-write ``(src, dst)`` device block copies, done before the
            forward pass.
        swap_out: ``(device block, cpu block)`` copies, done first of all.
        swap_in: ``(cpu block, device block)`` copies, done after the swap-outs.
        preempted: Sequences preempted this step.
        failed: Sequences finished without running (their adapter could not be loaded).
        capped: Sequences finished with ``"length"`` because the whole pool cannot hold their
            next token (they ran alone and still did not fit): without this they would
            preempt themselves and be re-admitted forever.
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)
    capped: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(s.num_new_tokens for s in self.scheduled)

    def is_empty(self) -> bool:
        """True when the step has nothing to run or copy."""
        return not (
            self.scheduled
            or self.swap_out
            or self.swap_in
            or self.block_copies
            or self.failed
            or self.capped
        )


class Scheduler:
    """Waiting and running queues over one KV cache manager.

    Args:
        kv: The KV cache manager.
        max_num_seqs: Most sequences running at once.
        max_num_batched_tokens: Token budget of a step.
        long_prefill_token_threshold: Most prefill work (token-equivalents, see
            ``attention_cost``) a step carries while a sequence decodes (0: no cap).
        tenant_prefill_tokens: Most prefill work a step carries while more than one tenant
            has work (0: no cap): the latency another tenant's long prompts may add to a step.
        attention_cost: Cost of attending to one context position, relative to the rest of a
            token's forward pass (``1 / alpha``; 0: every token costs 1): a prefill token at
            position ``p`` costs ``1 + p * attention_cost``.
        max_loras: Most distinct adapters in one step.
        lora_manager: Acquires and releases adapter slots (``adapters.manager.LoRAManager``);
            None when the engine serves no adapters.
        preemption: ``"recompute"`` or ``"swap"``.
        cpu_pool: The CPU block pool for ``"swap"`` (falls back to recompute when full).
    """

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int = 0,
        tenant_prefill_tokens: int = 0,
        attention_cost: float = 0.0,
        max_loras: int,
        preemption: str = "recompute",
        cpu_pool: CpuBlockPool | None = None,
        lora_manager: Any = None,
    ) -> None:
        if preemption not in ("recompute", "swap"):
            raise ValueError(f"unknown preemption policy {preemption!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.tenant_prefill_tokens = tenant_prefill_tokens
        self.attention_cost = attention_cost
        self.max_loras = max_loras
        self.preemption = preemption
        self.cpu_pool = cpu_pool
        self.lora_manager = lora_manager
        self.waiting = FairQueue()
        self.running: list[Sequence] = []
        self.swap_tables: dict[str, list[int]] = {}  # seq_id -> CPU blocks of a swapped seq
        self.num_preemptions = 0
        self.num_swapped_out = 0

    # ----------------------------------------------------------------------------- queues
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FCFS: at the back)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """Put a forked sequence into the running queue right after its parent."""
        if seq.request.lora_digest is not None:
            self.lora_manager.acquire(seq.request.lora_digest)  # resident: the parent holds it
        seq.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(after) + 1, seq)
        self.waiting.started(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the queues and release its blocks (and adapter slot) at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.waiting.stopped(seq)
            self._release_lora(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.kv.free(seq.seq_id)
        cpu_blocks = self.swap_tables.pop(seq.seq_id, None)
        if cpu_blocks and self.cpu_pool is not None:
            self.cpu_pool.free(cpu_blocks)
        seq.swapped = False
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, seqs: Iterable[Sequence], reason: str = "abort") -> None:
        """Finish sequences with ``reason`` (their blocks freed at once)."""
        for seq in seqs:
            if not seq.is_finished:
                self.finish(seq, reason)

    def requeue(self, seq: Sequence) -> None:
        """Preempt a running sequence to recompute it (its step's result is discarded)."""
        self.running.remove(seq)
        self.waiting.stopped(seq)
        self._preempt(seq, SchedulerOutput(), allow_swap=False)

    # ------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Decide the next step (see the module docstring)."""
        out = SchedulerOutput()
        self._preempt_for_fairness(out)
        self._schedule(out)
        if self.lora_manager is not None and len(out.scheduled) > 1:
            out.scheduled.sort(key=_adapter_key)
        for item in out.scheduled:  # computed tokens at the prompt rate, plus the sampled one
            self.waiting.charge(tenant_of(item.seq), item.num_new_tokens, int(item.sample))
        return out

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

    def _fits(self, seq: Sequence) -> bool:
        """Whether the pool has free (or evictable) blocks for the sequence's first chunk."""
        if seq.swapped:
            needed = -(-seq.num_tokens // self.kv.block_size)
        else:
            match = self.kv.get_computed_blocks(seq.hasher.block_hashes, seq.num_tokens)
            first = min(seq.num_tokens, match.num_cached_tokens + self.max_num_batched_tokens)
            needed = -(-first // self.kv.block_size) - len(match.blocks)
        return needed <= self.kv.num_free_blocks

    def _schedule(self, out: SchedulerOutput) -> SchedulerOutput:
        made_room = len(out.preempted)  # by fairness preemption: for the head, admit it now
        budget = self.max_num_batched_tokens
        allowance, shared = self._prefill_allowance()
        prefilling: set[str] = set()  # tenants with a prefill chunk in this step
        step_loras: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            tenant = tenant_of(seq)
            num_new = min(remaining, budget)
            start = seq.num_computed_tokens
            if remaining > 1:  # a prefill (or recompute) chunk: within its tenant's allowance
                num_new = self._tokens_within(start, num_new, allowance.get(tenant, 0.0))
                if shared and tenant in prefilling:  # one chunk per tenant while shared
                    num_new = 0
            if num_new <= 0:  # no allowance left this step (or nothing to compute)
                i += 1
                continue
            alloc = self._allocate_or_preempt(seq, num_new, out)
            if alloc is None:  # the sequence itself was preempted, or capped (finished)
                break
            self._record(out, seq, num_new, alloc)
            if remaining > 1:
                allowance[tenant] -= self._cost(start, num_new)
                prefilling.add(tenant)
            if seq.request.lora_digest is not None:
                step_loras.add(seq.request.lora_digest)
            budget -= num_new
            i += 1
        if len(out.preempted) > made_room:  # the pool is short: admit nothing new
            return out

        done: set[str] = set()  # tenants whose prefill turn in this step is over
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek(done)
            if seq is None:
                break
            tenant = tenant_of(seq)
            if allowance.get(tenant, 0.0) <= 0 or (shared and tenant in prefilling):
                done.add(tenant)  # its allowance (or its one chunk) is used: the next tenant
                continue
            lora = seq.request.lora_digest
            if lora is not None and lora not in step_loras and len(step_loras) >= self.max_loras:
                break
            if lora is not None:
                got = self._acquire_lora(seq)
                if got is None:  # the adapter is gone: fail this request, go on
                    self.waiting.remove(seq)
                    self.finish(seq, "abort")
                    out.failed.append(seq)
                    continue
                if not got:
                    break
            if seq.swapped:
                room = self._tokens_within(
                    seq.num_computed_tokens,
                    min(budget, seq.num_tokens - seq.num_computed_tokens),
                    allowance.get(tenant, 0.0),
                )
                if not self._swap_in(seq, room, out):
                    self._release_lora(seq)
                    if self._cap_if_alone(seq, out):
                        continue
                    break
            else:
                match = self.kv.get_computed_blocks(seq.hasher.block_hashes, seq.num_tokens)
                start = match.num_cached_tokens
                num_new = self._tokens_within(
                    start, min(seq.num_tokens - start, budget), allowance.get(tenant, 0.0)
                )
                alloc = self.kv.allocate_slots(
                    seq.seq_id,
                    num_new,
                    prefix=match,
                    block_hashes=seq.hasher.block_hashes,
                    stat_sources=seq.hasher.stat_sources(),
                )
                if alloc is None:
                    self._release_lora(seq)
                    if self._cap_if_alone(seq, out):
                        continue
                    break
                seq.num_computed_tokens = match.num_cached_tokens
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = match.num_cached_tokens
                self._record(out, seq, num_new, alloc)
            if seq.first_scheduled_time is None:  # its queue time ends here (not on re-admission)
                seq.first_scheduled_time = time.monotonic()
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.waiting.started(seq)
            if lora is not None:
                step_loras.add(lora)
            item = out.scheduled[-1]
            allowance[tenant] -= self._cost(item.start, item.num_new_tokens)
            prefilling.add(tenant)
            budget -= item.num_new_tokens
        return out

    def _prefill_allowance(self) -> tuple[dict[str, float], bool]:
        """Prefill work (token-equivalents) each tenant may do this step, and whether shared.

        A step's prefill work is the whole token budget; at most
        ``long_prefill_token_threshold`` while a running sequence decodes (its next token waits
        for the step); and at most ``tenant_prefill_tokens`` while more than one tenant has
        work (another tenant's long prompts add at most that much to a step). It is shared
        max-min fairly between the tenants that want some (running prefills, and the prompts
        of each waiting tenant's first ``max_num_seqs`` sequences): a tenant wanting less than
        an equal share gets all it wants, the others split the rest (water-filling). While
        shared, a tenant's work is one chunk of one sequence per step: each chunk gathers its
        whole context, so many small chunks of long prompts cost more than their tokens say.

        Returns:
            ``tenant -> allowance`` and whether more than one tenant has work.
        """
        demand: dict[str, float] = {}
        for s in self.running:
            remaining = s.num_tokens - s.num_computed_tokens
            if remaining > 1:
                t = tenant_of(s)
                demand[t] = demand.get(t, 0.0) + self._cost(s.num_computed_tokens, remaining)
        waiting = self.waiting.demand(self.max_num_seqs, lambda q: self._cost(0, q.num_tokens))
        for t, work in waiting.items():
            demand[t] = demand.get(t, 0.0) + work
        total = float(self.max_num_batched_tokens)
        caps = []
        if any(s.num_tokens - s.num_computed_tokens == 1 for s in self.running):
            caps.append(self.long_prefill_token_threshold)
        shared = bool(self.tenant_prefill_tokens) and (
            len(demand.keys() | self.waiting.running.keys()) > 1
        )
        if shared:
            caps.append(self.tenant_prefill_tokens)
        for cap in caps:
            if cap:
                total = min(total, float(cap))
        allowance: dict[str, float] = {}
        left = total
        ordered = sorted(demand.items(), key=lambda kv: kv[1])
        for k, (t, want) in enumerate(ordered):
            give = min(want, left / (len(ordered) - k))
            allowance[t] = give
            left -= give
        return allowance, shared

    def _cost(self, start: int, n: int) -> float:
        """Work of computing positions ``[start, start + n)``: ``n`` plus their attention."""
        return n + self.attention_cost * (n * start + n * (n + 1) / 2)

    def _tokens_within(self, start: int, most: int, allowance: float) -> int:
        """The most tokens from ``start`` (up to ``most``) whose work fits ``allowance``.

        At least one when the allowance covers half a token's work, so a prefill far into a
        long context still advances under a small cap.
        """
        if allowance <= 0 or most <= 0:
            return 0
        a = self.attention_cost
        if a == 0.0:
            n = int(allowance)
        else:  # a/2 n^2 + (1 + a (start + 1/2)) n <= allowance
            b = 1.0 + a * (start + 0.5)
            n = int((math.sqrt(b * b + 2.0 * a * allowance) - b) / a)
        if self._cost(start, n + 1) <= allowance * (1 + 1e-9):  # the root's rounding
            n += 1
        if n == 0 and allowance >= self._cost(start, 1) / 2:
            n = 1
        return min(most, n)

    def _cap_if_alone(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Finish the waiting head with ``"length"`` if it cannot fit even in an idle pool.

        With nothing running and nothing scheduled, every block is free or evictable: a head
        that still does not fit never will, and leaving it at the head would stall every
        request behind it while the engine spins on empty steps.

        Returns:
            True when the sequence was finished (and taken off the waiting queue).
        """
        if self.running or out.scheduled:
            return False
        self.waiting.remove(seq)
        self.finish(seq, "length")
        out.capped.append(seq)
        return True

    def _acquire_lora(self, seq: Sequence) -> bool | None:
        """Take a slot for the sequence's adapter.

        Returns:
            True on success, False when every slot is busy, None when the adapter cannot be
            loaded (removed, or its files invalid): the reason goes to ``seq.stop_reason``.
        """
        try:
            return self.lora_manager.acquire(seq.request.lora_digest) is not None
        except ValueError as exc:  # AdapterError
            seq.stop_reason = str(exc)
            return None

    def _release_lora(self, seq: Sequence) -> None:
        if seq.request.lora_digest is not None and self.lora_manager is not None:
            self.lora_manager.release(seq.request.lora_digest)

    def _record(self, out: SchedulerOutput, seq: Sequence, num_new: int, alloc) -> None:
        start = seq.num_computed_tokens
        out.block_copies.extend((c.src, c.dst) for c in alloc.copies)
        out.scheduled.append(ScheduledSeq(seq, start, num_new, start + num_new == seq.num_tokens))

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
                out.capped.append(seq)
                return None
            victim = self.running.pop()
            self.waiting.stopped(victim)
            self._preempt(victim, out)
            if victim is seq:
                return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput, allow_swap: bool = True) -> None:
        """Move a running sequence back to the front of the waiting queue."""
        self.num_preemptions += 1
        out.preempted.append(seq)
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
        seq.swapped = swapped
        if not swapped:
            seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
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
        out.scheduled.append(
            ScheduledSeq(seq, restored, num_new, restored + num_new == seq.num_tokens)
        )
        return True


def _adapter_key(item: ScheduledSeq) -> str:
    """Batch-order key: the adapter digest, base model (``""``) first."""
    return item.seq.request.lora_digest or ""
