"""Fault isolation for the batched parts of a step: one request's fault fails that request alone.

A step runs every scheduled sequence of every tenant in one forward pass and one sampler call,
so an exception raised by one request's data (a tensor the model chokes on, a sampling value
that overflows) would otherwise end the step for all of them, and the engine loop with it.
When a batched call raises, it is retried one sequence (one row) at a time; the sequences that
still fail alone are the culprits, every other sequence gets the result it would have had.

Re-running a forward pass is safe: a sequence's KV writes for the step's positions are a pure
function of its tokens and the KV before them, so writing them again gives the same values.
The copies of the step (swap, copy-on-write) ran before the failing forward and are not
repeated. The retry costs one forward pass per sequence, and only when something failed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from loraplex.engine.scheduler import ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class IsolatedForward:
    """The forward pass of a step, with its failing sequences set apart.

    Attributes:
        kept: Scheduled sequences whose forward pass succeeded, in batch order.
        rows: For each of ``kept``, its ``[1, vocab]`` logits row (None when it does not
            sample); None as a whole when the batched pass succeeded (then ``logits`` holds
            every row).
        logits: ``[num_sampling, vocab]`` logits of the batched pass when it succeeded.
        culprits: Sequences that failed alone, with their exception.
    """

    kept: list[ScheduledSeq]
    rows: list[torch.Tensor | None] | None = None
    logits: torch.Tensor | None = None
    culprits: list[tuple[ScheduledSeq, BaseException]] = field(default_factory=list)


def execute_isolating(runner: Any, kv: Any, sched: SchedulerOutput) -> IsolatedForward:
    """``runner.execute(sched, kv)``, retried per sequence if it raises.

    Args:
        runner: The model runner (``execute(sched, kv) -> logits | None``).
        kv: The KV cache manager.
        sched: The step.

    Returns:
        The batched result, or the per-sequence results and the culprits.

    Raises:
        Exception: what the batched pass raised, when the step has no sequence to blame (only
            block copies failed).
    """
    try:
        return IsolatedForward(kept=list(sched.scheduled), logits=runner.execute(sched, kv))
    except Exception as exc:
        if not sched.scheduled:
            raise
        logger.warning(
            "a step of %d sequences failed (%s: %s); retrying them one at a time",
            len(sched.scheduled),
            type(exc).__name__,
            exc,
        )
    result = IsolatedForward(kept=[], rows=[])
    for item in sched.scheduled:
        try:
            logits = runner.execute(SchedulerOutput(scheduled=[item]), kv)
        except Exception as exc:  # this sequence's own fault
            result.culprits.append((item, exc))
            continue
        result.kept.append(item)
        result.rows.append(logits)  # type: ignore[union-attr]
    return result


def sample_rows_isolating(sample: Any, num_rows: int) -> tuple[list[Any], dict[int, BaseException]]:
    """Call ``sample(rows)`` for all rows, or row by row if the batched call raises.

    Args:
        sample: ``list[int] -> SamplerOutput`` over the given row indices.
        num_rows: Rows in the batch.

    Returns:
        The per-row ``(token_id, logprob, rank, top_logprobs)`` of the rows that succeeded
        (None for the others) and ``row -> exception`` for the rows that failed alone.
    """
    try:
        out = sample(list(range(num_rows)))
        return list(zip(out.token_ids, out.logprobs, out.ranks, out.top_logprobs, strict=True)), {}
    except Exception as exc:
        logger.warning("sampling %d rows failed (%s); retrying them one at a time", num_rows, exc)
    results: list[Any] = [None] * num_rows
    failed: dict[int, BaseException] = {}
    for r in range(num_rows):
        try:
            out = sample([r])
        except Exception as exc:
            failed[r] = exc
            continue
        results[r] = (out.token_ids[0], out.logprobs[0], out.ranks[0], out.top_logprobs[0])
    return results, failed
