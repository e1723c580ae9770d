"""The scheduler's one writer: what a step produced, applied (``Scheduler.update_from_output``).

A mixin of :class:`engine.scheduler.Scheduler`, split out to keep files single-purpose: token
appends and block hashes, finish rules (stop token ids, EOS unless ``ignore_eos``, a complete
structured output, ``max_tokens``, the model length), the ``n > 1`` fork, and faults. It uses
the scheduler's queues and KV manager (``self.kv``, ``self.seqs``, ``self.requests``,
``self.finish``, ``self.requeue``).
"""

from __future__ import annotations

from loraplex.engine.breadcrumb import STEP
from loraplex.engine.scheduler_output import (
    EngineCoreOutput,
    Logprob,
    ModelRunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
)
from loraplex.engine.sequence import Sequence, SequenceStatus


class OutputUpdate:
    """``update_from_output`` and its helpers (mixed into ``Scheduler``)."""

    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply what a step produced: the one writer of tokens, hashes, status and finishes.

        For each sampling sequence: its token (or, at an ``n > 1`` request's first token, one
        per fork) is appended and hashed, and the sequence finishes on a stop token id, EOS
        (unless ``ignore_eos``), ``max_tokens`` or the model length. A sequence whose part of
        the step failed (``result.failed``) fails its whole request with ``"error"``; the
        blocks it was filling lose their cached hashes (their KV may be half written), and a
        sequence of the step holding one of them (a prefix hit taken this step) is requeued
        to be recomputed, its token discarded.

        Returns:
            One output per sequence that produced a token or finished.
        """
        outputs, self._pending = self._pending, []  # finished while scheduling
        by_id = {item.seq_id: item for item in sched.scheduled}
        bad_blocks = self._fail(result.failed, by_id, outputs)
        for item in sched.scheduled:
            seq = self.seqs.get(item.seq_id)
            if seq is None or seq.is_finished:  # failed (or aborted) meanwhile
                continue
            if bad_blocks and bad_blocks.intersection(self.kv.get_block_ids(seq.seq_id)):
                self.requeue(seq)
                continue
            tokens = result.sampled.get(item.seq_id) if item.sample else None
            logprobs = result.logprobs.get(item.seq_id)
            if item.num_spec_tokens and tokens:
                counted = item.seq_id not in result.undrafted
                outputs.append(self._verified(seq, item, tokens, logprobs, counted))
                continue
            seq.num_computed_tokens = item.start + item.num_new_tokens
            if not tokens:
                continue
            targets = self._fork(seq, item.fork_ids) if item.fork_ids else [seq]
            for k, target in enumerate(targets):
                outputs.append(self._append(target, tokens[k], logprobs[k] if logprobs else None))
        for seq_id, proposals in result.spec_token_ids.items():
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                seq.spec_token_ids = proposals
        for out in outputs:
            out.request_finished = out.request_id not in self.requests
        return outputs

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
            item = by_id.get(seq_id)
            if item is not None:
                bad_blocks.update(self.kv.uncache_from(seq_id, item.start // self.kv.block_size))
            requests.setdefault(seq.request.request_id, where)
        for rid, where in requests.items():
            state = self.requests.get(rid)
            for seq in list(state.seqs) if state is not None else []:
                if not seq.is_finished:
                    self.finish(seq, "error")
                    out = core_output(seq, [], None, "error")
                    out.error = f"the request failed in {where}"
                    outputs.append(out)
        return bad_blocks

    def _verified(
        self,
        seq: Sequence,
        item: ScheduledSeq,
        tokens: list[int],
        logprobs: list[Logprob] | None,
        counted: bool = True,
    ) -> EngineCoreOutput:
        """Apply a speculating sequence's step: ``a`` accepted proposals and the target's token.

        Its KV is kept up to the last accepted proposal; blocks holding only rejected ones
        go back to the pool (``KVCacheManager.trim``). The tokens are appended one by one, so
        a stop token or length limit among them finishes the sequence there and drops the
        rest.

        Args:
            seq: The sequence.
            item: Its share of the step (its proposals, or how many were to be drafted).
            tokens: The ``a + 1`` tokens the runner kept.
            logprobs: Their logprobs, when asked for.
            counted: False when the draft model did not draft it after all: its step was a
                plain decode and says nothing about acceptance.

        Returns:
            One output with the tokens kept, finished as the last of them finished it.
        """
        num_proposed, num_accepted = item.num_spec_tokens, len(tokens) - 1
        if counted:
            self.spec_stats.record(num_proposed, num_accepted)
            if seq.spec is not None:
                seq.spec.update(num_proposed, num_accepted)
        seq.num_computed_tokens = item.start + len(tokens)
        self.kv.trim(seq.seq_id, seq.num_computed_tokens)
        merged: EngineCoreOutput | None = None
        for k, token in enumerate(tokens):
            out = self._append(seq, token, logprobs[k] if logprobs else None)
            if merged is None:
                merged = out
            else:
                merged.new_token_ids.extend(out.new_token_ids)
                if merged.new_logprobs is not None and out.new_logprobs is not None:
                    merged.new_logprobs.extend(out.new_logprobs)
                merged.finish_reason, merged.stop_reason = out.finish_reason, out.stop_reason
                merged.ends_on_stop_token, merged.error = out.ends_on_stop_token, out.error
            if seq.is_finished:
                break
        return merged

    def _fork(self, parent: Sequence, fork_ids: tuple[str, ...]) -> list[Sequence]:
        """Fork an ``n > 1`` request's sequence into ``n`` sharing its prompt blocks."""
        state = self.requests[parent.request.request_id]
        children = [parent]
        for i, child_id in enumerate(fork_ids[1:], start=1):
            child = Sequence(
                seq_id=child_id,
                request=parent.request,
                index=i,
                token_ids=list(parent.token_ids),
                hasher=parent.hasher.fork(),
                num_computed_tokens=parent.num_computed_tokens,
                status=SequenceStatus.RUNNING,
                num_cached_tokens=parent.num_cached_tokens,
                first_scheduled_time=parent.first_scheduled_time,
            )
            if parent.grammar is not None:  # before the parent consumes its own token
                with self.breadcrumb.on(STEP, parent.request.request_id):
                    child.grammar = parent.grammar.deep_copy()
            self.kv.fork(parent.seq_id, child.seq_id)
            if child.request.lora_digest is not None:
                self.lora_manager.acquire(child.request.lora_digest)  # the parent holds it
            self.running.insert(self.running.index(children[-1]) + 1, child)
            self.waiting.started(child)
            self.seqs[child_id] = child
            children.append(child)
        state.seqs = children
        state.forked = True
        return children

    def _append(self, seq: Sequence, token: int, logprob: Logprob | None) -> EngineCoreOutput:
        """Add a sampled token; finish the sequence on a stop token, EOS, or a length limit."""
        seq.token_ids.append(token)
        seq.hasher.extend([token])
        params = seq.request.sampling
        reason: str | None = None
        stop_reason: int | None = None
        grammar_done = False
        if seq.grammar is not None:
            with self.breadcrumb.on(STEP, seq.request.request_id):
                consumed = seq.grammar.consume_token(token)
            if not consumed:
                self.finish(seq, "error")
                out = core_output(seq, [token], None if logprob is None else [logprob], "error")
                out.error = "the request failed in structured output"
                return out
            grammar_done = seq.grammar.is_stopped()
        if token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif (token in self.eos_token_ids and not params.ignore_eos) or grammar_done:
            reason = "stop"  # EOS, or a structured output that is complete
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.finish(seq, reason, stop_reason)
        out = core_output(seq, [token], None if logprob is None else [logprob], reason, stop_reason)
        out.ends_on_stop_token = reason == "stop" and (
            token in params.stop_token_ids or token in self.eos_token_ids
        )
        return out


def core_output(
    seq: Sequence,
    tokens: list[int],
    logprobs: list[Logprob] | None,
    finish_reason: str | None,
    stop_reason: int | str | None = None,
) -> EngineCoreOutput:
    """One sequence's :class:`EngineCoreOutput` of a step (or of its finish)."""
    return EngineCoreOutput(
        request_id=seq.request.request_id,
        index=seq.index,
        new_token_ids=tokens,
        new_logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        num_cached_tokens=seq.num_cached_tokens or 0,
        first_scheduled_time=seq.first_scheduled_time,
    )
