"""The scheduler's output applier: what one step produced, written into its sequences.

A member of :class:`~loraplex.engine.scheduling.scheduler.Scheduler`, called only from
``Scheduler.update_from_output`` (vLLM v1's ``Scheduler.update_from_output`` and its
``_update_request_with_output``): token appends and block hashes, the finish rules (a stop
token id, EOS unless ``ignore_eos``, a complete structured output, ``max_tokens``, the model
length), speculative decoding's verified tokens (the KV manager's trim of the rejected
proposals' blocks, decided here once) and the ``n > 1`` fork's children.

It writes a sequence's own fields (tokens, hashes, computed tokens, grammar, adaptive ``k``)
and decides how it finishes; it never moves a sequence between the scheduler's queues: the
output it returns says the finish (``finish_reason``), and ``update_from_output`` applies it
through ``Scheduler.finish``.
"""

from __future__ import annotations

from collections.abc import Iterable

from loraplex.engine.core.breadcrumb import STEP, Breadcrumb
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.sampling.logprobs import PromptLogprob
from loraplex.engine.scheduling.output import EngineCoreOutput, Logprob, ScheduledSeq
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.spec_decode import SpecDecodeStats


class OutputApplier:
    """Applies a step's tokens to sequences and decides their finishes.

    Args:
        kv: The KV cache manager (speculative trims, forks, a failed step's blocks).
        eos_token_ids: Tokens that finish a sequence with ``"stop"`` (unless ``ignore_eos``).
        max_model_len: Longest sequence; reaching it finishes one with ``"length"``.
        spec_stats: Where verified proposals are counted (the engine's statistics).
        breadcrumb: Where each call into a grammar matcher (native code) is marked with its
            request (``engine.core.breadcrumb``).
    """

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        spec_stats: SpecDecodeStats,
        breadcrumb: Breadcrumb,
    ) -> None:
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.spec_stats = spec_stats
        self.breadcrumb = breadcrumb

    def uncache_failed(self, seq_id: str, item: ScheduledSeq | None) -> list[int]:
        """A sequence whose part of the step raised: the blocks it was filling leave the cache.

        Their KV may be half written, so no later request may hit them.

        Returns:
            Their physical ids (a sequence of the step holding one must be recomputed).
        """
        if item is None:
            return []
        return self.kv.uncache_from(seq_id, item.start // self.kv.block_size)

    def advance(self, seq: Sequence, item: ScheduledSeq) -> None:
        """The step computed the item's positions: they count as computed."""
        seq.num_computed_tokens = item.start + item.num_new_tokens

    @staticmethod
    def add_prompt_logprobs(seq: Sequence, first: int, entries: list[PromptLogprob]) -> None:
        """Keep a chunk's prompt logprobs (of prompt tokens ``first, first + 1, ...``).

        Positions already kept (a chunk computed again after a preemption) are skipped.
        """
        kept = seq.prompt_logprobs
        if kept is None:
            return
        skip = len(kept) + 1 - first  # prompt token len(kept) + 1 is the next one owed
        if skip < 0:
            raise RuntimeError(
                f"{seq.seq_id}: prompt logprobs from token {first}, but token {len(kept) + 1} "
                "is owed"
            )
        kept.extend(entries[skip:])

    @staticmethod
    def take_prompt_logprobs(seq: Sequence) -> list[PromptLogprob] | None:
        """A sequence's prompt logprobs, once its prompt is computed (None: not owed).

        From now on the sequence owes none (a later recompute may take prefix-cache hits).
        """
        kept = seq.prompt_logprobs
        if kept is None or seq.num_computed_tokens < seq.num_prompt_tokens:
            return None
        seq.prompt_logprobs = None
        return kept

    def append(self, seq: Sequence, token: int, logprob: Logprob | None) -> EngineCoreOutput:
        """Add a sampled token and decide whether it finishes the sequence.

        The finish rules, in order: a token the grammar refuses (``"error"``), a stop token id
        (``"stop"``, the token is the ``stop_reason``), EOS (unless ``ignore_eos``) or a
        complete structured output (``"stop"``), ``max_tokens`` or the model length
        (``"length"``).

        Returns:
            The sequence's output for the token. A ``finish_reason`` set on it is a decision
            the caller applies (``Scheduler.finish``); the sequence is not finished here.
        """
        seq.token_ids.append(token)
        seq.hasher.extend([token])
        params = seq.request.sampling
        logprobs = None if logprob is None else [logprob]
        reason: str | None = None
        stop_reason: int | None = None
        grammar_done = False
        if seq.grammar is not None:
            with self.breadcrumb.on(STEP, seq.request.request_id):
                consumed = seq.grammar.consume_token(token)
            if not consumed:
                return core_output(
                    seq, [token], logprobs, "error", error="the request failed in structured output"
                )
            grammar_done = seq.grammar.is_stopped()
        if token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif (token in self.eos_token_ids and not params.ignore_eos) or grammar_done:
            reason = "stop"  # EOS, or a structured output that is complete
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        out = core_output(seq, [token], logprobs, reason, stop_reason)
        out.ends_on_stop_token = reason == "stop" and (
            token in params.stop_token_ids or token in self.eos_token_ids
        )
        return out

    def verified(
        self,
        seq: Sequence,
        item: ScheduledSeq,
        tokens: list[int],
        logprobs: list[Logprob] | None,
        counted: bool = True,
    ) -> tuple[EngineCoreOutput, int | None]:
        """Apply a speculating sequence's step: ``a`` accepted proposals and the target's token.

        Its KV is kept up to the last accepted proposal: the blocks holding only rejected ones
        go back to the pool (``KVCacheManager.trim``), a decision made here once and carried
        to the runner (``SchedulerOutput.kv_trims``). The tokens are appended one by one, so a
        stop token or length limit among them ends the output there and drops the rest.

        Args:
            seq: The sequence.
            item: Its share of the step (its proposals, or how many were to be drafted).
            tokens: The ``a + 1`` tokens the runner kept.
            logprobs: Their logprobs, when asked for.
            counted: False when the draft model did not draft it after all: its step was a
                plain decode and says nothing about acceptance.

        Returns:
            ``(output, kept_blocks)``: one output with the tokens kept, with the finish the
            last of them decided (for the caller to apply); and the number of blocks its table
            keeps after the trim, None when the trim gave nothing back.
        """
        num_proposed, num_accepted = item.num_spec_tokens, len(tokens) - 1
        if counted:
            self.spec_stats.record(num_proposed, num_accepted)
            if seq.spec is not None:
                seq.spec.update(num_proposed, num_accepted)
        seq.num_computed_tokens = item.start + len(tokens)
        freed = self.kv.trim(seq.seq_id, seq.num_computed_tokens)
        kept_blocks = self.kv.num_blocks_of(seq.seq_id) if freed else None
        merged: EngineCoreOutput | None = None
        for k, token in enumerate(tokens):
            out = self.append(seq, token, logprobs[k] if logprobs else None)
            if merged is None:
                merged = out
            else:
                merged.new_token_ids.extend(out.new_token_ids)
                if merged.new_logprobs is not None and out.new_logprobs is not None:
                    merged.new_logprobs.extend(out.new_logprobs)
                merged.finish_reason, merged.stop_reason = out.finish_reason, out.stop_reason
                merged.ends_on_stop_token, merged.error = out.ends_on_stop_token, out.error
            if out.finish_reason is not None:
                break
        return merged, kept_blocks

    def fork_child(self, parent: Sequence, child_id: str, index: int) -> Sequence:
        """An ``n > 1`` request's child ``index``: the parent's tokens, hashes and blocks.

        Call it before the parent's first token is appended (the child gets its own). The
        child shares every block of the parent (``KVCacheManager.fork``); its grammar matcher
        is a copy of the parent's. The caller puts it in the queues (and takes its adapter
        reference).
        """
        child = Sequence(
            seq_id=child_id,
            request=parent.request,
            index=index,
            token_ids=list(parent.token_ids),
            hasher=parent.hasher.fork(),
            num_computed_tokens=parent.num_computed_tokens,
            status=SequenceStatus.RUNNING,
            num_cached_tokens=parent.num_cached_tokens,
            first_scheduled_time=parent.first_scheduled_time,
        )
        if parent.grammar is not None:
            with self.breadcrumb.on(STEP, parent.request.request_id):
                child.grammar = parent.grammar.deep_copy()
        self.kv.fork(parent.seq_id, child.seq_id)
        return child


def core_output(
    seq: Sequence,
    tokens: list[int],
    logprobs: list[Logprob] | None,
    finish_reason: str | None,
    stop_reason: int | str | None = None,
    *,
    error: str | None = None,
) -> EngineCoreOutput:
    """One sequence's :class:`EngineCoreOutput` of a step (or of its finish).

    Args:
        seq: The sequence.
        tokens: Its new token ids.
        logprobs: Their logprobs (None when not asked).
        finish_reason: How it finished (None while running).
        stop_reason: The stop token id that finished it.
        error: Why it failed (``"error"``) or could not run (``"abort"``: its adapter could
            not be loaded): the message its client sees.
    """
    return EngineCoreOutput(
        request_id=seq.request.request_id,
        index=seq.index,
        new_token_ids=tokens,
        new_logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        num_cached_tokens=seq.num_cached_tokens or 0,
        error=error,
        first_scheduled_time=seq.first_scheduled_time,
    )
