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
   (``engine.scheduling.fair_queue``: the oldest waiting sequence of the tenant that has
   received the least service; first come, first served within a tenant and when there are no
   tenants): prefix lookup, then room for as much of the rest as the budget allows (chunked
   prefill). The first one that does not fit stops admission (no overtaking), as does
   ``max_num_seqs``, and a sequence whose adapter cannot get a device slot (every slot held
   by running sequences).
   Admission takes a reference on the adapter's slot, finishing or preemption drops it, so
   the running sequences, and so every step, never hold more distinct adapters than slots;
   and since nothing overtakes, requests waiting for a slot are served in that order across
   adapters (no starvation).
   Priority classes come first: steps 1 and 2 run for the interactive class, then for the
   batch class (``EngineRequest.priority``); a batch sequence is admitted only while no
   interactive sequence waits, batch sequences are the first preempted (steps 0 and 1, and
   for an adapter slot an interactive head needs), running batch sequences sit out a step
   that carries an interactive prefill (at most ``BATCH_MAX_SIT_OUT`` in a row), and for
   ``batch_yield_s`` after an interactive arrival the batch class's prefills are capped, so
   batch work uses only the capacity interactive traffic leaves (:meth:`Scheduler._schedule`).
   Prefill work is shared between tenants within each step (``engine.scheduling.budget``), so a
   newcomer's short prompt is computed in the step it is admitted and another tenant's long
   prompts cannot stretch every decoder's step.
3. The step's sequences are put in batch order grouped by adapter (a stable sort, base model
   first), so every adapter's tokens form one contiguous segment of the flattened batch:
   Punica's SGMV layout, where each segment's LoRA shrink/expand works on a view of the
   activations in place, with no gather or scatter. Each tenant's counter is charged with the
   step's tokens.

The step is one-way (``engine.scheduling.output``): :meth:`Scheduler.schedule` says everything
the model runner needs (new sequences, new block ids, copy-on-write copies, LoRA slots, image
spans, forks), and :meth:`Scheduler.update_from_output` is the one writer of what the step
produced: token ids, block hashes, status and finish reasons (EOS, stop token ids,
``max_tokens``, the model length, the ``n > 1`` fork, faults), and the KV manager's trim of a
speculating sequence's rejected proposals, which the step's output carries to the runner
(``SchedulerOutput.kv_trims``). Stop strings are found by the client side's output processor,
whose hit comes back through :meth:`Scheduler.finish_request`.

The scheduler is composed, not mixed: it owns a :class:`Preemptor`
(``engine.scheduling.preemption``: victims, recompute, swap) and an :class:`OutputApplier`
(``engine.scheduling.output_applier``: appends, finish rules, speculative trims, fork
children), each built here with what it uses and nothing of the scheduler's. Modelled on
vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.core.breadcrumb import STEP, Breadcrumb
from loraplex.engine.kv_cache import KVCacheManager, PrefixMatch, SlotAllocation
from loraplex.engine.kv_cache.swap import CpuBlockPool
from loraplex.engine.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE, EngineRequest
from loraplex.engine.scheduling.budget import PrefillBudget
from loraplex.engine.scheduling.fair_queue import FairQueue, priority_of, tenant_of
from loraplex.engine.scheduling.output import (
    EngineCoreOutput,
    ImageSpan,
    ModelRunnerOutput,
    NewSeq,
    ScheduledSeq,
    SchedulerOutput,
)
from loraplex.engine.scheduling.output_applier import OutputApplier, core_output
from loraplex.engine.scheduling.preemption import Preemptor
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.spec_decode import AdaptiveK, SpecDecodeStats
from loraplex.engine.spec_decode.adaptive import DRAFT_MAX_FAILED_PROBES
from loraplex.engine.structured_output.grammar import grammar_bitmask, speculative_bitmasks

BATCH_MAX_SIT_OUT = 4
"""Most steps in a row running batch sequences sit out for interactive prefills; the next
one carries their decodes too, so a stream of interactive prompts cannot stall them forever."""


@dataclass
class _Step:
    """What is left of a step while it is scheduled (``Scheduler._schedule``'s passes).

    Attributes:
        budget: Tokens left in the step.
        allowance: ``tenant -> prefill work`` left (``engine.scheduling.budget``).
        shared: The allowance is shared (one chunk per tenant).
        prefilling: Tenants with a prefill chunk in the step.
        loras: Adapters of the step.
        prefilled: A prefill chunk (or an admission) is in the step.
        short: A pass preempted for room (the pool is short): admit nothing new. Fairness
            preemption (step 0) does not count: it made room for the head, admitted now.
    """

    budget: int
    allowance: dict[str, float] = field(default_factory=dict)
    shared: bool = False
    prefilling: set[str] = field(default_factory=set)
    loras: set[str] = field(default_factory=set)
    prefilled: bool = False
    short: bool = False


@dataclass
class _RequestSeqs:
    """A request's sequences (one until its ``n > 1`` fork)."""

    request: EngineRequest
    seqs: list[Sequence]
    forked: bool = False


class Scheduler:
    """Waiting and running queues over one KV cache manager (vLLM v1's ``Scheduler``).

    Who writes what (the rule the members keep):

    - A sequence moves between queues only through the scheduler's transitions: :meth:`add`
      (``WAITING``), :meth:`_admit` (``RUNNING``), :meth:`_preempt`
      (``PREEMPTED``, back at the front of the waiting queue: fairness, a short pool, a
      requeue after a fault) and :meth:`finish` (``FINISHED``). The :class:`Preemptor` only
      chooses victims and moves their KV; it reports, the transition applies.
    - What a step produced is written by :meth:`update_from_output` alone, through its
      :class:`OutputApplier` (called from nowhere else): token ids, block hashes, computed
      tokens, finish decisions (applied through :meth:`finish`), speculative trims (carried
      to the runner in ``SchedulerOutput.kv_trims``), fork children.
    - Between steps only the client's :meth:`finish_request` (abort, a stop string) and
      :meth:`add` change anything.

    Args:
        kv: The KV cache manager.
        max_num_seqs: Most sequences running at once.
        budget: The per-step prefill allowance (``engine.scheduling.budget``).
        max_loras: Most distinct adapters in one step.
        max_model_len: Longest sequence; reaching it finishes one with ``"length"``.
        eos_token_ids: Tokens that finish a sequence with ``"stop"`` (unless ``ignore_eos``).
        lora_manager: Acquires and releases adapter slots (``engine.lora.slots.LoRAManager``);
            None when the engine serves no adapters.
        preemption: ``"recompute"`` or ``"swap"``.
        cpu_pool: The CPU block pool for ``"swap"`` (falls back to recompute when full).
        num_speculative_tokens: Most proposals a decoding sequence verifies per step (0: no
            speculative decoding). A decode with proposals computes ``1 + k`` positions, ``k``
            of them in lookahead slots; ``k`` is the sequence's adaptive count
            (``engine.spec_decode.AdaptiveK``), cut to what the step's token budget,
            ``max_tokens`` and the model length leave, and to 0 when the pool cannot hold the
            lookahead slots (speculation never preempts anything).
        draft_model: The runner drafts proposals itself (a draft model): every decode may
            speculate, with ``num_draft_tokens``; otherwise (n-gram) a decode speculates on
            the proposals the last step returned.
        breadcrumb: Where each call into a sequence's grammar matcher (native code) is marked
            with its request (``engine.core.breadcrumb``); marks nothing when None.
        atomic_image_spans: Never end a prefill chunk inside an image's placeholder span (a
            model whose image tokens attend to each other in both directions, Gemma 3): a
            chunk that would is cut back to the span's start, or, when it starts inside or at
            the span, taken to the span's end if the step's budget holds it (else it waits).
        batch_yield_s: For this long after an interactive request is added, the batch class's
            prefill work in a step is at most the budget's ``tenant_prefill_tokens`` (0: never
            capped); see :meth:`_schedule`.

    Attributes:
        preemptor: Victim choice and the KV side of preemption
            (``engine.scheduling.preemption``).
        output_applier: Applies a step's result for :meth:`update_from_output`
            (``engine.scheduling.output_applier``).
        spec_stats: Proposals verified and accepted so far.

    Raises:
        ValueError: an unknown preemption policy.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        budget: PrefillBudget,
        max_loras: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        preemption: str = "recompute",
        cpu_pool: CpuBlockPool | None = None,
        lora_manager: Any = None,
        num_speculative_tokens: int = 0,
        draft_model: bool = False,
        breadcrumb: Breadcrumb | None = None,
        atomic_image_spans: bool = False,
        batch_yield_s: float = 0.0,
    ) -> None:
        self.kv = kv
        self.atomic_image_spans = atomic_image_spans
        self.batch_yield_s = batch_yield_s
        self.max_num_seqs = max_num_seqs
        self.budget = budget
        self.max_num_batched_tokens = budget.max_num_batched_tokens
        self.max_loras = max_loras
        self.max_model_len = max_model_len
        self.lora_manager = lora_manager
        self.spec_k = num_speculative_tokens
        self.draft_model = draft_model
        self.breadcrumb = breadcrumb if breadcrumb is not None else Breadcrumb()
        self.spec_stats = SpecDecodeStats()
        self.preemptor = Preemptor(kv, policy=preemption, cpu_pool=cpu_pool)
        self.output_applier = OutputApplier(
            kv,
            eos_token_ids=eos_token_ids,
            max_model_len=max_model_len,
            spec_stats=self.spec_stats,
            breadcrumb=self.breadcrumb,
        )
        self.waiting = FairQueue()
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence
        self.requests: dict[str, _RequestSeqs] = {}
        self._dropped: list[str] = []  # preempted since the last step: the runner drops them
        self._finished: list[str] = []  # finished since the last step
        self._pending: list[EngineCoreOutput] = []  # outputs of sequences finished in schedule
        self._interactive_at = float("-inf")  # when the last interactive request was added
        self._sat_out = 0  # steps in a row the running batch sequences sat out

    # ------------------------------------------------------------------------ figures
    @property
    def num_preemptions(self) -> int:
        """Preemptions so far (the preemptor's count)."""
        return self.preemptor.num_preemptions

    @property
    def num_swapped_out(self) -> int:
        """Preemptions whose KV went to the CPU pool."""
        return self.preemptor.num_swapped_out

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The EOS ids of the finish rules (the output applier's)."""
        return self.output_applier.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Iterable[int]) -> None:
        self.output_applier.eos_token_ids = frozenset(ids)

    # ----------------------------------------------------------------- transitions
    def add(self, seq: Sequence) -> None:
        """Queue a new request's first sequence (at the back of its tenant's queue)."""
        seq.status = SequenceStatus.WAITING
        self.seqs[seq.seq_id] = seq
        self.requests[seq.request.request_id] = _RequestSeqs(seq.request, [seq])
        self.waiting.append(seq)
        if seq.request.priority == PRIORITY_INTERACTIVE:
            self._interactive_at = time.monotonic()

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Take a sequence out of the queues and release its blocks (and adapter slot) at once.

        Args:
            seq: The sequence (a finished one is left alone).
            reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``.
            stop_reason: The stop token id or stop string that finished it.
        """
        if seq.is_finished:
            return
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
        self.preemptor.forget(seq.seq_id)
        seq.swapped = False
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason if reason != "abort" else seq.stop_reason
        self.seqs.pop(seq.seq_id, None)
        self._finished.append(seq.seq_id)
        state = self.requests.get(seq.request.request_id)
        if state is not None and all(s.is_finished for s in state.seqs):
            del self.requests[seq.request.request_id]

    def finish_request(
        self,
        request_id: str,
        reason: str = "abort",
        stop_reason: int | str | None = None,
        index: int | None = None,
    ) -> list[Sequence]:
        """Finish a request's sequences (or only the one of ``index``): abort, a stop string.

        Returns:
            The sequences finished now (none for an unknown or finished request).
        """
        state = self.requests.get(request_id)
        if state is None:
            return []
        if not state.forked:  # an n > 1 request not forked yet ends whole
            index = None
        done = []
        for seq in list(state.seqs):
            if not seq.is_finished and (index is None or seq.index == index):
                self.finish(seq, reason, stop_reason)
                done.append(seq)
        return done

    def _preempt(self, seq: Sequence, out: SchedulerOutput, *, allow_swap: bool = True) -> None:
        """Move a running sequence back to the front of the waiting queue (``PREEMPTED``).

        The one path to preemption (fairness, a short pool, a requeue after a fault): the
        preemptor releases (or swaps out) its blocks, the sequence forgets its computed tokens
        unless swapped, and the runner is told to drop it.
        """
        self.running.remove(seq)
        self.waiting.stopped(seq)
        self._release_lora(seq)
        swapped = self.preemptor.evict(seq, out, allow_swap=allow_swap)
        seq.spec_token_ids = []
        seq.swapped = swapped
        if not swapped:
            seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        if seq.known_to_runner:
            seq.known_to_runner = False
            self._dropped.append(seq.seq_id)
        self.waiting.appendleft(seq)

    def _admit(self, seq: Sequence) -> None:
        """Move the waiting sequence just scheduled to the running queue (``RUNNING``)."""
        self.waiting.remove(seq)
        if seq.first_scheduled_time is None:  # its queue time ends here (not on re-admission)
            seq.first_scheduled_time = time.monotonic()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.waiting.started(seq)

    def _refuse(self, seq: Sequence, out: SchedulerOutput, error: str) -> None:
        """Finish with ``"abort"`` a waiting sequence whose adapter cannot be loaded.

        ``error`` (the loader's message) goes in its output's ``error``, reported this step.
        """
        self.finish(seq, "abort")
        out.failed.append(seq.seq_id)
        self._pending.append(core_output(seq, [], None, "abort", error=error))

    def _cap(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Finish with ``"length"`` a sequence the pool can never hold (reported this step)."""
        self.finish(seq, "length")
        out.capped.append(seq.seq_id)
        self._pending.append(core_output(seq, [], None, "length"))

    def _fork(self, parent: Sequence, fork_ids: tuple[str, ...]) -> list[Sequence]:
        """Fork an ``n > 1`` request's sequence into ``n`` running ones sharing its blocks."""
        state = self.requests[parent.request.request_id]
        children = [parent]
        for i, child_id in enumerate(fork_ids[1:], start=1):
            child = self.output_applier.fork_child(parent, child_id, i)
            if child.request.lora_digest is not None:
                self.lora_manager.acquire(child.request.lora_digest)  # the parent holds it
            self.running.insert(self.running.index(children[-1]) + 1, child)
            self.waiting.started(child)
            self.seqs[child_id] = child
            children.append(child)
        state.seqs = children
        state.forked = True
        return children

    # ------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Decide the next step (see the module docstring).

        Returns:
            Everything the runner needs for the step; sequences finished while scheduling (an
            adapter that cannot load, a sequence the pool can never hold) are reported by the
            next :meth:`update_from_output`.
        """
        out = SchedulerOutput()
        out.dropped_seq_ids, self._dropped = self._dropped, []
        out.finished_seq_ids, self._finished = self._finished, []
        self._preempt_for_fairness(out)
        self._schedule(out)
        out.dropped_seq_ids.extend(self._dropped)  # preempted by this schedule
        self._dropped = []
        if self.lora_manager is not None and len(out.scheduled) > 1:
            digest = {s.seq_id: s.request.lora_digest or "" for s in self.running}
            out.scheduled.sort(key=lambda item: digest.get(item.seq_id, ""))
        for item in out.scheduled:  # computed tokens at the prompt rate, plus the sampled one
            seq = self.seqs[item.seq_id]
            self.waiting.charge(tenant_of(seq), item.num_new_tokens, int(item.sample))
            if item.sample and seq.grammar is not None:
                with self.breadcrumb.on(STEP, seq.request.request_id):
                    item.token_bitmask = grammar_bitmask(seq.grammar)
        return out

    def _preempt_for_fairness(self, out: SchedulerOutput) -> None:
        """Step 0: if the fair head is blocked, preempt one sequence of an over-served tenant.

        The victim is the preemptor's choice (``Preemptor.fairness_victim``).
        """
        head = self.waiting.peek()
        if head is None or not self.running:
            return
        if len(self.running) < self.max_num_seqs and self._fits(head):
            return
        victim = self.preemptor.fairness_victim(head, self.running, self.waiting, self.max_num_seqs)
        if victim is not None:
            self._preempt(victim, out)

    def _allocate_or_preempt(
        self, seq: Sequence, num_new: int, out: SchedulerOutput
    ) -> SlotAllocation | None:
        """Allocate for a running sequence, preempting the newest ones until it fits.

        Returns:
            The allocation; None when the sequence itself was preempted, or capped (alone and
            still no room: every other block is free or evictable, so the pool can never hold
            its next token; preempting it would only re-admit it forever, a livelock).
        """
        while True:
            alloc = self.kv.allocate_slots(
                seq.seq_id,
                num_new,
                num_computed_tokens=seq.num_computed_tokens,
                block_hashes=seq.hasher.block_hashes,
            )
            if alloc is not None:
                return alloc
            # Blocks pinned by a KV tier transfer come back within a step or two: not a cap.
            if self.running[-1] is seq and len(self.running) == 1 and not self.kv.num_pinned:
                self._cap(seq, out)
                return None
            victim = self.preemptor.room_victim(self.running)
            self._preempt(victim, out)
            if victim is seq:
                return None

    def _swap_in(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        """Admit a swapped sequence: fresh device blocks, KV copied back from the CPU pool."""
        restored = seq.num_computed_tokens
        num_new = min(seq.num_tokens - restored, budget)
        if not self.preemptor.swap_in(seq, num_new, out):
            return False
        seq.swapped = False
        self._record(out, seq, restored, num_new, SlotAllocation())
        return True

    def _fits(self, seq: Sequence) -> bool:
        """Whether the pool has free (or evictable) blocks for the sequence's first chunk."""
        if seq.swapped:
            needed = -(-seq.num_tokens // self.kv.block_size)
        else:
            match = self._prefix(seq)
            first = min(seq.num_tokens, match.num_cached_tokens + self.max_num_batched_tokens)
            needed = -(-first // self.kv.block_size) - len(match.blocks)
        return needed <= self.kv.num_free_blocks

    def _prefix(self, seq: Sequence) -> PrefixMatch:
        """The cached prefix a waiting sequence may start from.

        None for a sequence that still owes prompt logprobs: a cached block holds KV, not the
        logits of its positions, so every prompt position is computed (vLLM v1 does the same);
        its full blocks are still registered for other requests.
        """
        if seq.prompt_logprobs is not None:
            return PrefixMatch(num_queried_tokens=seq.num_tokens)
        return self.kv.get_computed_blocks(seq.hasher.block_hashes, seq.num_tokens)

    def _schedule(self, out: SchedulerOutput) -> None:
        """Steps 1 and 2, the interactive class first; batch sequences sit out its prefills.

        The interactive pass schedules the running interactive sequences and admits waiting
        interactive ones, within an allowance counted over the interactive class alone (the
        batch class's work neither shares nor caps it). If it scheduled a prefill chunk (an
        interactive request's time to first token), the running batch sequences sit the step
        out: they keep their blocks and adapter slots, and run in the next step without one,
        or in the step after :data:`BATCH_MAX_SIT_OUT` such steps in a row, which they join
        with at most ``tenant_prefill_tokens`` of prefill work. Otherwise the batch pass
        schedules them, then admits batch lines while no interactive one waits, with what the
        step has left, under the allowance of every class; within ``batch_yield_s`` of an
        interactive arrival that allowance is at most ``tenant_prefill_tokens``, so the step
        an interactive request may arrive during stays short. With no batch sequence anywhere
        the interactive pass is the whole step, as before the classes. vLLM v1's ``priority``
        policy admits by class and preempts the lowest class first, as steps 0-2 do; the
        class-first pass, the sit-out and the cap are ours (docs/engine.md, *Priority
        classes*).
        """
        step = _Step(self.max_num_batched_tokens)
        interactive = [s for s in self.running if priority_of(s) == PRIORITY_INTERACTIVE]
        batch = [s for s in self.running if priority_of(s) != PRIORITY_INTERACTIVE]
        if batch or self.waiting.waits_after(PRIORITY_INTERACTIVE):
            step.allowance, step.shared = self.budget.allowance(
                self.running, self.waiting, self.max_num_seqs, PRIORITY_INTERACTIVE
            )
        else:  # one class: the allowance of every sequence (the same numbers)
            step.allowance, step.shared = self.budget.allowance(
                self.running, self.waiting, self.max_num_seqs
            )
        # after BATCH_MAX_SIT_OUT steps sat out, the batch decodes' tokens are kept for them
        reserve = min(len(batch), step.budget // 2) if self._sat_out >= BATCH_MAX_SIT_OUT else 0
        step.budget -= reserve
        self._schedule_running(out, interactive, step)
        if not step.short:  # the pool is short: admit nothing new
            self._admit_waiting(out, step, PRIORITY_INTERACTIVE)
        step.budget += reserve
        if not batch:
            self._sat_out = 0
            if step.prefilled or not self.waiting.waits_after(PRIORITY_INTERACTIVE):
                return  # one class, or an interactive prefill: no batch line is admitted
        elif step.prefilled and self._sat_out < BATCH_MAX_SIT_OUT:
            self._sat_out += 1
            return  # an interactive prefill is in the step: the batch class sits it out
        self._sat_out = 0
        batch = [s for s in batch if s.status is SequenceStatus.RUNNING]
        cap = self.budget.tenant_prefill_tokens
        if step.prefilled:  # batch sequences sat out the steps they may: they join this one
            step.allowance, step.shared = self.budget.allowance(
                batch, FairQueue(), self.max_num_seqs, PRIORITY_BATCH, cap=cap
            )
            self._schedule_running(out, batch, step)
            return
        recent = time.monotonic() - self._interactive_at < self.batch_yield_s
        step.allowance, step.shared = self.budget.allowance(
            self.running, self.waiting, self.max_num_seqs, cap=cap if recent else 0
        )
        self._schedule_running(out, batch, step)
        if not step.short and not self.waiting.waits_before(PRIORITY_BATCH):
            self._admit_waiting(out, step, None)  # (a waiting interactive head had its turn)

    def _schedule_running(self, out: SchedulerOutput, seqs: list[Sequence], step: _Step) -> None:
        """Step 1 for ``seqs`` (running, oldest first): each gets the tokens it still needs.

        A sequence preempted meanwhile (a room victim of an older one) is passed over; when
        the sequence being scheduled is itself preempted (or capped), the pass ends.
        """
        cost, within = self.budget.cost, self.budget.tokens_within
        allowance = step.allowance
        preempted = len(out.preempted)
        for seq in seqs:
            if step.budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted for room in this pass
                continue
            budget = step.budget
            remaining = seq.num_tokens - seq.num_computed_tokens
            tenant = tenant_of(seq)
            num_new = min(remaining, budget)
            start = seq.num_computed_tokens
            if remaining > 1:  # a prefill (or recompute) chunk: within its tenant's allowance
                num_new = within(start, num_new, allowance.get(tenant, 0.0))
                if step.shared and tenant in step.prefilling:  # one chunk per tenant if shared
                    num_new = 0
                num_new = self._whole_images(seq, start, num_new, budget)
            if num_new <= 0:  # no allowance left this step (or nothing to compute)
                continue
            k, alloc, masks = (
                self._allocate_lookahead(seq, budget) if remaining == 1 else (0, None, [])
            )
            if alloc is None:
                alloc = self._allocate_or_preempt(seq, num_new, out)
            if alloc is None:  # the sequence itself was preempted, or capped (finished)
                break
            self._record(out, seq, start, num_new, alloc)
            if k:
                item = out.scheduled[-1]
                if self.draft_model:
                    item.num_draft_tokens = k
                else:
                    item.spec_token_ids = seq.spec_token_ids[:k]
                    item.spec_bitmasks = masks
                item.num_new_tokens += k
                num_new += k
            if remaining > 1:
                allowance[tenant] -= cost(start, num_new)
                step.prefilling.add(tenant)
                step.prefilled = True
            if seq.request.lora_digest is not None:
                step.loras.add(seq.request.lora_digest)
            step.budget -= num_new
        if len(out.preempted) > preempted:
            step.short = True

    def _admit_waiting(self, out: SchedulerOutput, step: _Step, priority: int | None) -> None:
        """Step 2: admit waiting sequences in fair order (only of class ``priority`` if given)."""
        cost, within = self.budget.cost, self.budget.tokens_within
        allowance, shared, prefilling = step.allowance, step.shared, step.prefilling
        step_loras = step.loras
        done: set[str] = set()  # tenants whose prefill turn in this step is over
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            budget = step.budget
            seq = self.waiting.peek(done)
            if seq is None or self.waiting.waits_before(seq.request.priority):
                break  # a batch sequence only takes what no interactive one waits for
            if priority is not None and priority_of(seq) != priority:
                break  # the interactive pass admits interactive sequences only
            tenant = tenant_of(seq)
            if allowance.get(tenant, 0.0) <= 0 or (shared and tenant in prefilling):
                done.add(tenant)  # its allowance (or its one chunk) is used: the next tenant
                continue
            lora = seq.request.lora_digest
            if lora is not None and lora not in step_loras and len(step_loras) >= self.max_loras:
                break
            if lora is not None:
                got, error = self._acquire_lora(seq)
                if not got and error is None and self._free_slot_for(seq, out):
                    got, error = self._acquire_lora(seq)
                if error is not None:  # the adapter is gone: fail this request, go on
                    self._refuse(seq, out, error)
                    continue
                if not got:
                    break
            if seq.swapped:
                room = within(
                    seq.num_computed_tokens,
                    min(budget, seq.num_tokens - seq.num_computed_tokens),
                    allowance.get(tenant, 0.0),
                )
                whole = self._whole_images(seq, seq.num_computed_tokens, room, budget)
                if whole <= 0 < room:  # its image does not fit this step: it waits
                    self._release_lora(seq)
                    break
                if not self._swap_in(seq, whole, out):
                    self._release_lora(seq)
                    if self._cap_if_alone(seq, out):
                        continue
                    break
            else:
                match = self._prefix(seq)
                start = match.num_cached_tokens
                num_new = within(
                    start, min(seq.num_tokens - start, budget), allowance.get(tenant, 0.0)
                )
                whole = self._whole_images(seq, start, num_new, budget)
                if whole <= 0 < num_new:  # its image does not fit this step: it waits
                    self._release_lora(seq)
                    break
                num_new = whole
                alloc = self.kv.allocate_slots(
                    seq.seq_id,
                    num_new,
                    prefix=match if seq.prompt_logprobs is None else None,
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
                self._record(out, seq, start, num_new, alloc)
            self._admit(seq)
            if lora is not None:
                step_loras.add(lora)
            item = out.scheduled[-1]
            allowance[tenant] -= cost(item.start, item.num_new_tokens)
            prefilling.add(tenant)
            step.prefilled = True
            step.budget -= item.num_new_tokens

    def _free_slot_for(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Preempt batch sequences so an interactive head blocked on an adapter slot gets one.

        The victims are the preemptor's choice (``Preemptor.slot_victims``): every running
        sequence of one adapter only batch sequences use. None is in this step yet (the batch
        pass comes after the interactive one), so nothing scheduled is undone.

        Returns:
            True when a slot was freed.
        """
        if priority_of(seq) != PRIORITY_INTERACTIVE or self.lora_manager is None:
            return False
        victims = self.preemptor.slot_victims(self.running)
        for victim in victims:
            self._preempt(victim, out)
        return bool(victims)

    def _whole_images(self, seq: Sequence, start: int, num_new: int, budget: int) -> int:
        """``num_new`` changed so the chunk ends outside every image span (atomic spans only).

        A chunk ``[start, start + num_new)`` ending inside a span ``[s, e)`` is cut back to
        ``s`` when ``s > start``, else extended to ``e`` when ``e - start`` fits ``budget``, else
        it is 0: the sequence waits for a step with room (validation keeps every span within
        ``max_num_batched_tokens``).
        """
        if not self.atomic_image_spans or num_new <= 0:
            return num_new
        end = start + num_new
        for image in seq.request.images:
            s, e = image.placeholder.offset, image.placeholder.end
            if s < end < e:
                if s > start:
                    return s - start
                return e - start if e - start <= budget else 0
        return num_new

    def _allocate_lookahead(
        self, seq: Sequence, budget: int
    ) -> tuple[int, SlotAllocation | None, list[bytes]]:
        """A decode's slot and ``k`` lookahead slots for its proposals, if it speculates.

        A structured-output sequence verifies only the proposals its grammar allows (n-gram
        proposals are known here; a draft model's are not, so with one it does not speculate),
        with a bitmask for each position.

        Returns:
            ``(k, allocation, bitmasks)``; ``(0, None, [])`` when it does not speculate this
            step, or the pool cannot hold the lookahead slots without preempting (then the
            plain decode allocates as usual).
        """
        none: tuple[int, None, list[bytes]] = (0, None, [])
        available = self.spec_k if self.draft_model else len(seq.spec_token_ids)
        if not available or (seq.grammar is not None and self.draft_model):
            return none
        params = seq.request.sampling
        limit = min(
            available,
            budget - 1,
            params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if limit <= 0:
            return none
        if seq.spec is None:
            give_up = DRAFT_MAX_FAILED_PROBES if self.draft_model else None
            seq.spec = AdaptiveK(self.spec_k, max_failed_probes=give_up)
        k = min(seq.spec.next_k(), limit)
        masks: list[bytes] = []
        if k > 0 and seq.grammar is not None:
            with self.breadcrumb.on(STEP, seq.request.request_id):
                masks = speculative_bitmasks(seq.grammar, seq.spec_token_ids[:k])
            k = len(masks)
        if k <= 0:
            return none
        alloc = self.kv.allocate_slots(
            seq.seq_id,
            1,
            num_computed_tokens=seq.num_computed_tokens,
            block_hashes=seq.hasher.block_hashes,
            num_lookahead_tokens=k,
        )
        return (k, alloc, masks) if alloc is not None else none

    def _cap_if_alone(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Finish the waiting head with ``"length"`` if it cannot fit even in an idle pool.

        With nothing running, nothing scheduled and no block pinned by a KV tier transfer,
        every block is free or evictable: a head that still does not fit never will, and
        leaving it at the head would stall every request behind it while the engine spins on
        empty steps.

        Returns:
            True when the sequence was finished (and taken off the waiting queue).
        """
        if self.running or out.scheduled or self.kv.num_pinned:
            return False
        self._cap(seq, out)
        return True

    def _acquire_lora(self, seq: Sequence) -> tuple[bool, str | None]:
        """Take a slot for the sequence's adapter.

        Returns:
            ``(True, None)`` on success, ``(False, None)`` when every slot is busy,
            ``(False, message)`` when the adapter cannot be loaded (removed, or its files
            invalid): the message travels in the request's output ``error``.
        """
        try:
            return self.lora_manager.acquire(seq.request.lora_digest) is not None, None
        except ValueError as exc:  # AdapterError
            return False, str(exc)

    def _release_lora(self, seq: Sequence) -> None:
        if seq.request.lora_digest is not None and self.lora_manager is not None:
            self.lora_manager.release(seq.request.lora_digest)

    def _lora_slot(self, seq: Sequence) -> int:
        digest = seq.request.lora_digest
        if digest is None or self.lora_manager is None:
            return -1
        slot = self.lora_manager.slot_of(digest)
        if slot is None:  # acquired at admission: it must be resident
            raise RuntimeError(f"adapter {digest} of {seq.seq_id} holds no device slot")
        return slot

    def _record(
        self, out: SchedulerOutput, seq: Sequence, start: int, num_new: int, alloc: SlotAllocation
    ) -> None:
        """Add a sequence's share of the step: its new blocks, copies, slot, images, fork."""
        end = start + num_new
        out.block_copies.extend((c.src, c.dst) for c in alloc.copies)
        item = ScheduledSeq(
            seq.seq_id,
            start,
            num_new,
            sample=end == seq.num_tokens and seq.request.sampling.max_tokens > 0,
            lora_slot=self._lora_slot(seq),
            image_spans=_image_spans(seq, start, end),
            prompt_logprobs=seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1,
        )
        if seq.known_to_runner:
            item.new_block_ids = list(alloc.new_block_ids)
            item.copies = [(c.logical_index, c.dst) for c in alloc.copies]
        else:  # the whole table, after this step's allocation, goes in the NewSeq
            out.new_seqs.append(self._new_seq(seq, item.lora_slot))
        n = seq.request.sampling.n
        if item.sample and n > 1 and not self.requests[seq.request.request_id].forked:
            rid = seq.request.request_id
            item.fork_ids = (seq.seq_id, *(f"{rid}#{i}" for i in range(1, n)))
        out.scheduled.append(item)

    def _new_seq(self, seq: Sequence, lora_slot: int) -> NewSeq:
        seq.known_to_runner = True
        seed = seq.request.sampling.seed
        return NewSeq(
            seq_id=seq.seq_id,
            token_ids=list(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens,
            block_ids=self.kv.get_block_ids(seq.seq_id),
            sampling=seq.request.sampling,
            seed=None if seed is None else seed + seq.index,
            lora_slot=lora_slot,
            images=seq.request.images,
            cache_salt=seq.request.cache_salt,
        )

    # ------------------------------------------------------------------------- update
    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply what a step produced: the one writer of tokens, hashes, status and finishes.

        For each sampling sequence: its token (or, at an ``n > 1`` request's first token, one
        per fork) is appended and hashed, and the sequence finishes on a stop token id, EOS
        (unless ``ignore_eos``), ``max_tokens`` or the model length. A speculating sequence
        keeps its accepted proposals and the target's token; the KV manager trims the blocks
        of the rejected ones, and the trim is recorded in ``sched.kv_trims`` for the runner
        (``ModelRunner.apply_kv_trims``). A sequence whose part of the step failed
        (``result.failed``) fails its whole request with ``"error"``; the blocks it was
        filling lose their cached hashes (their KV may be half written), and a sequence of the
        step holding one of them (a prefix hit taken this step) is requeued to be recomputed,
        its token discarded.

        Args:
            sched: The step's plan, as :meth:`schedule` returned it.
            result: What the runner produced for it.

        Returns:
            One output per sequence that produced a token or finished (those finished while
            scheduling included).
        """
        applier = self.output_applier
        outputs, self._pending = self._pending, []  # finished while scheduling
        by_id = {item.seq_id: item for item in sched.scheduled}
        bad_blocks = self._fail(result.failed, by_id, outputs)
        for item in sched.scheduled:
            seq = self.seqs.get(item.seq_id)
            if seq is None or seq.is_finished:  # failed (or aborted) meanwhile
                continue
            if bad_blocks and bad_blocks.intersection(self.kv.get_block_ids(seq.seq_id)):
                self._preempt(seq, SchedulerOutput(), allow_swap=False)  # requeue: recompute
                continue
            tokens = result.sampled.get(item.seq_id) if item.sample else None
            logprobs = result.logprobs.get(item.seq_id)
            if item.num_spec_tokens and tokens:
                counted = item.seq_id not in result.undrafted
                out, kept_blocks = applier.verified(seq, item, tokens, logprobs, counted)
                out.prompt_logprobs = applier.take_prompt_logprobs(seq)  # a prompt's last token
                if kept_blocks is not None:
                    sched.kv_trims[item.seq_id] = kept_blocks
                outputs.append(self._apply_finish(seq, out))
                continue
            applier.advance(seq, item)
            if item.seq_id in result.prompt_logprobs:
                applier.add_prompt_logprobs(seq, *result.prompt_logprobs[item.seq_id])
            if not tokens:
                prefilled = seq.num_computed_tokens == seq.num_tokens
                if prefilled and seq.request.sampling.max_tokens == 0:
                    outputs.extend(self._prefill_only(seq))
                continue
            targets = self._fork(seq, item.fork_ids) if item.fork_ids else [seq]
            for k, target in enumerate(targets):
                out = applier.append(target, tokens[k], logprobs[k] if logprobs else None)
                if k == 0:
                    out.prompt_logprobs = applier.take_prompt_logprobs(seq)
                outputs.append(self._apply_finish(target, out))
        for seq_id, proposals in result.spec_token_ids.items():
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                seq.spec_token_ids = proposals
        for out in outputs:
            out.request_finished = out.request_id not in self.requests
        return outputs

    def _prefill_only(self, seq: Sequence) -> list[EngineCoreOutput]:
        """A ``max_tokens=0`` request whose prompt is computed: it finishes with ``"length"``.

        Every one of its ``n`` outputs ends with no token (no fork: nothing was sampled);
        index 0's carries the prompt logprobs.
        """
        first = core_output(seq, [], None, "length")
        first.prompt_logprobs = self.output_applier.take_prompt_logprobs(seq)
        self.finish(seq, "length")
        outs = [first]
        for index in range(1, seq.request.sampling.n):
            out = core_output(seq, [], None, "length")
            out.index = index
            outs.append(out)
        return outs

    def _apply_finish(self, seq: Sequence, out: EngineCoreOutput) -> EngineCoreOutput:
        """Finish the sequence if the applier decided so on its output."""
        if out.finish_reason is not None:
            self.finish(seq, out.finish_reason, out.stop_reason)
        return out

    def _fail(
        self, failed: dict[str, str], by_id: dict[str, ScheduledSeq], outputs: list
    ) -> set[int]:
        """Fail the requests of sequences whose part of the step raised; their fresh blocks."""
        bad_blocks: set[int] = set()
        requests: dict[str, str] = {}
        for seq_id, where in failed.items():
            seq = self.seqs.get(seq_id)
            if seq is None:
                continue
            bad_blocks.update(self.output_applier.uncache_failed(seq_id, by_id.get(seq_id)))
            requests.setdefault(seq.request.request_id, where)
        for rid, where in requests.items():
            state = self.requests.get(rid)
            for seq in list(state.seqs) if state is not None else []:
                if not seq.is_finished:
                    self.finish(seq, "error")
                    error = f"the request failed in {where}"
                    outputs.append(core_output(seq, [], None, "error", error=error))
        return bad_blocks


def _image_spans(seq: Sequence, start: int, end: int) -> list[ImageSpan]:
    """The image features positions ``[start, end)`` of a sequence take."""
    spans = []
    for i, image in enumerate(seq.request.images):
        ph = image.placeholder
        lo, hi = max(start, ph.offset), min(end, ph.end)
        if lo < hi:
            spans.append(ImageSpan(i, lo - start, lo - ph.offset, hi - lo))
    return spans
