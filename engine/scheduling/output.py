"""What crosses the engine core's one-way step: scheduler -> runner -> scheduler -> client.

vLLM v1's contract at nano-vllm's size::

    Scheduler.schedule()            -> SchedulerOutput   (what to run; everything the runner
                                                          needs, no Sequence, no manager)
    ModelRunner.execute(sched)      -> ModelRunnerOutput (sampled ids and logprobs per sequence)
    Scheduler.update_from_output()  -> list[EngineCoreOutput]  (the one writer of tokens,
                                                          hashes, status and finish reasons)
    ModelRunner.apply_kv_trims(sched.kv_trims)           (speculative decoding: the KV
                                                          manager's trim, for the runner)

The runner keeps its own per-sequence state (block table, token ids, sampling params,
generator) from the :class:`NewSeq` it is sent once and the per-step :class:`ScheduledSeq`
updates; nothing downstream calls back into the scheduler, the KV cache manager or the LoRA
manager during a step. Every change to a runner's block table comes from the scheduler's side:
the new blocks and copy-on-write replacements of ``ScheduledSeq``, and after verification the
KV manager's trim (``SchedulerOutput.kv_trims``, filled in by ``update_from_output``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.request import ImageInput
from loraplex.engine.sampling.logprobs import PromptLogprob, TopLogprobs
from loraplex.engine.sampling.params import SamplingParams


@dataclass(slots=True)
class NewSeq:
    """A sequence the runner holds no state for: admitted, resumed after a preemption, or forked.

    Attributes:
        seq_id: Its id.
        token_ids: Every token it has (prompt, plus outputs when resumed or forked).
        num_prompt_tokens: How many of ``token_ids`` are the prompt (penalties and
            ``min_tokens`` tell the two apart).
        block_ids: Its whole block table after this step's allocation.
        sampling: Its sampling params.
        seed: Its generator's seed (the request's seed plus its index), None for the engine's
            shared generator. A fork child's generator was made at the fork step.
        lora_slot: Its adapter's device slot, -1 for the base model.
        images: The prompt's images (pixel values and placeholders), in placeholder order.
        cache_salt: Scopes the vision-encoder cache (the tenant).
    """

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    sampling: SamplingParams
    seed: int | None
    lora_slot: int
    images: list[ImageInput]
    cache_salt: str | None


@dataclass(slots=True)
class ImageSpan:
    """Image features spliced into one sequence's tokens of a step.

    Attributes:
        image: Index in the sequence's ``images``.
        row: First of the step's rows (of this sequence's tokens) it covers.
        first: First feature row of the image it covers.
        count: Rows covered.
    """

    image: int
    row: int
    first: int
    count: int


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step.

    Attributes:
        seq_id: The sequence.
        start: Its computed tokens before the step: the first position computed.
        num_new_tokens: Positions ``[start, start + num_new_tokens)`` are computed.
        sample: The step ends at its last token, so a token is sampled.
        new_block_ids: Physical blocks appended to its table this step (for a sequence sent as
            a ``NewSeq`` in this step they are already in its ``block_ids``).
        copies: Copy-on-write replacements in its table, ``(logical index, new block)``.
        lora_slot: Its adapter's device slot (-1: base model).
        image_spans: The image features its tokens of this step take.
        fork_ids: ``n > 1``: the step samples one token for each of these ids (the sequence
            itself first), and the scheduler forks the others from it; empty otherwise.
        token_bitmask: Structured output: the ids its grammar allows for the sampled token,
            one bit each (``engine.structured_output.grammar.grammar_bitmask``); None when free.
        spec_token_ids: Speculative decoding: ``k`` proposed tokens that follow its last
            token. ``num_new_tokens`` is then ``1 + k`` (its last token and the proposals, the
            proposals in lookahead slots) and the target's token is sampled at every one of
            those positions (``engine.spec_decode.verify``).
        spec_bitmasks: Structured output with proposals: the mask of the position after each
            proposal (``engine.structured_output.grammar.speculative_bitmasks``), one per proposal;
            ``token_bitmask`` is the first position's.
        num_draft_tokens: Speculative decoding with a draft model: the runner drafts this
            many proposals itself at the start of the step (``engine.spec_decode.draft``);
            ``num_new_tokens`` is ``1 + num_draft_tokens`` and ``spec_token_ids`` is empty.
        prompt_logprobs: The runner computes the logprobs of the prompt tokens that follow
            the step's positions (``sampling.prompt_logprobs``; only the positions before the
            prompt's last token, whose logits sample the first output token).
    """

    seq_id: str
    start: int
    num_new_tokens: int
    sample: bool
    new_block_ids: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    lora_slot: int = -1
    image_spans: list[ImageSpan] = field(default_factory=list)
    fork_ids: tuple[str, ...] = ()
    token_bitmask: bytes | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    spec_bitmasks: list[bytes] = field(default_factory=list)
    num_draft_tokens: int = 0
    prompt_logprobs: bool = False

    @property
    def num_spec_tokens(self) -> int:
        """Proposals verified in the step (known ahead, or drafted by the runner)."""
        return len(self.spec_token_ids) or self.num_draft_tokens

    @property
    def num_sample_rows(self) -> int:
        """Logits rows the step computes for it: ``1 + k`` when it samples, else 0."""
        return 1 + len(self.spec_token_ids) if self.sample else 0


@dataclass
class SchedulerOutput:
    """What one step runs.

    Attributes:
        new_seqs: Sequences the runner learns about in this step.
        scheduled: Sequences in the step, in batch order (grouped by adapter).
        block_copies: Copy-on-write ``(src, dst)`` device block copies, before the forward.
        swap_out: ``(device block, cpu block)`` copies, done first of all.
        swap_in: ``(cpu block, device block)`` copies, done after the swap-outs.
        dropped_seq_ids: Sequences preempted since the last step: the runner drops their
            tables and tokens (a resumed one comes back as a ``NewSeq``), keeping its generator.
        finished_seq_ids: Sequences finished since the last step: the runner drops everything.
        preempted: Sequences preempted by this step (scheduler side, for statistics).
        failed: Sequences finished without running (their adapter could not be loaded).
        capped: Sequences finished with ``"length"`` because the pool cannot hold their next
            token (they ran alone and still did not fit).
        kv_trims: Speculative decoding, filled in by ``Scheduler.update_from_output`` after the
            step ran: ``seq_id -> blocks its table keeps``, for each sequence whose rejected
            proposals' blocks the KV cache manager gave back (``KVCacheManager.trim``). The
            runner cuts its tables to these lengths (``ModelRunner.apply_kv_trims``) before
            the next step; it never works the trim out itself.
    """

    new_seqs: list[NewSeq] = field(default_factory=list)
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    dropped_seq_ids: list[str] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    capped: list[str] = field(default_factory=list)
    kv_trims: dict[str, int] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(s.num_new_tokens for s in self.scheduled)

    def is_empty(self) -> bool:
        """True when the step has nothing to run, copy or report."""
        return not (
            self.scheduled
            or self.swap_out
            or self.swap_in
            or self.block_copies
            or self.failed
            or self.capped
        )


Logprob = tuple[float, TopLogprobs]
"""A sampled token's logprob and its top alternatives."""


@dataclass
class ModelRunnerOutput:
    """What one step produced.

    Attributes:
        sampled: Per sampling sequence, its token, or one token per ``fork_ids`` entry, or for
            a speculating sequence the ``a + 1`` tokens it keeps (``a`` accepted proposals,
            then the target's own token).
        logprobs: Per sequence that asked for logprobs, aligned with ``sampled``.
        failed: Sequences whose part of the step raised, with where (their requests fail;
            every other sequence of the step ran as if they had not been there).
        forward_seconds: Time of the forward pass and logits.
        spec_token_ids: Proposals for the next step, per sequence that sampled (speculative
            decoding); the scheduler decides how many of them to verify.
        undrafted: Sequences scheduled to verify drafted proposals that the draft model did
            not draft (they ran as plain decodes; no acceptance is counted for them).
        prompt_logprobs: Per sequence scheduled with ``prompt_logprobs``: ``(p, entries)``,
            the logprobs of prompt tokens ``p, p + 1, ...`` (``p >= 1``).
    """

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    forward_seconds: float = 0.0
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    undrafted: set[str] = field(default_factory=set)
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    """One sequence's news from a step, as the client side receives it.

    Attributes:
        request_id: Its request.
        index: Its output index (``0 .. n-1``).
        new_token_ids: Tokens generated this step (the last may be a stop token: see
            ``ends_on_stop_token``).
        new_logprobs: Their logprobs when asked, else None.
        finish_reason: None while running, then ``"stop"``, ``"length"``, ``"abort"`` or
            ``"error"``.
        stop_reason: The stop token id that finished it (None for EOS and other reasons).
        num_cached_tokens: Prompt tokens served from the prefix cache.
        error: Why it ended without finishing normally, as its client is told: where a fault
            failed it (``finish_reason == "error"``), or why the core could not run it
            (``finish_reason == "abort"``: its adapter could not be loaded).
        request_finished: Every sequence of its request has finished (the core forgot it).
        first_scheduled_time: ``time.monotonic()`` of its first admission, None before.
        ends_on_stop_token: The last new token is the EOS or stop token id that finished it
            (its text is left out unless ``include_stop_str_in_output``); False when a
            complete structured output finished it (the token is content).
        prompt_logprobs: The request asked for ``prompt_logprobs``: every prompt token's
            after the first (``len(prompt) - 1`` entries), once, on index 0's output of the
            step that completed the prompt; None otherwise.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    request_finished: bool = False
    first_scheduled_time: float | None = None
    ends_on_stop_token: bool = False
    prompt_logprobs: list[PromptLogprob] | None = None
