"""Fault isolation for the batched parts of a step: one request's fault fails that request alone.

A step runs every scheduled sequence of every tenant in one forward pass and one sampler call,
so an exception raised by one request's data (a tensor the model chokes on, a sampling value
that overflows) would otherwise end the step for all of them, and the engine loop with it.
When a batched call raises, it is retried one sequence (one row) at a time; the sequences that
still fail alone are the culprits, every other sequence gets the result it would have had.

Re-running a forward pass is safe: a sequence's KV writes for the step's positions are a pure
function of its tokens and the KV before them, so writing them again gives the same values.
The copies of the step (swap, copy-on-write) run before the forward pass and are not
repeated. The retry costs one forward pass per sequence, and only when something failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass
class IsolatedForward:
    """The forward pass of a step, with its failing sequences set apart.

    Attributes:
        kept: Scheduled sequences whose forward pass succeeded, in batch order.
        culprits: Sequences that failed alone, with their exception.
        rows: ``seq_id -> [num_sample_rows, vocab]`` logits of each kept sequence that
            samples (one row, or ``1 + k`` for a speculating sequence).
    """

    kept: list[Any] = field(default_factory=list)
    culprits: list[tuple[Any, BaseException]] = field(default_factory=list)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)

    def logits_of(self, item: Any) -> torch.Tensor:
        """The ``[num_sample_rows, vocab]`` logits of a kept sampling sequence."""
        return self.rows[item.seq_id]


def execute_isolating(
    forward: Callable[[list[Any]], torch.Tensor | None], items: list[Any]
) -> IsolatedForward:
    """``forward(items)``, retried one sequence at a time if it raises.

    Args:
        forward: Runs a forward pass over scheduled sequences; ``item.num_sample_rows``
            logits rows per sequence, in order (None when none samples).
        items: The step's scheduled sequences (``ScheduledSeq``), in batch order.

    Returns:
        The kept sequences and their logits rows, and the culprits.
    """
    result = IsolatedForward()
    try:
        logits = forward(items)
    except Exception as exc:
        logger.warning(
            "a step of %d sequences failed (%s: %s); retrying them one at a time",
            len(items),
            type(exc).__name__,
            exc,
        )
    else:
        result.kept = list(items)
        _split_rows(result, items, logits)
        return result
    for item in items:
        try:
            logits = forward([item])
        except Exception as exc:  # this sequence's own fault
            result.culprits.append((item, exc))
            continue
        result.kept.append(item)
        _split_rows(result, [item], logits)
    return result


def _split_rows(result: IsolatedForward, items: list[Any], logits: torch.Tensor | None) -> None:
    """Give each sampling item its ``num_sample_rows`` consecutive rows of ``logits``."""
    row = 0
    for item in items:
        n = item.num_sample_rows
        if n:
            result.rows[item.seq_id] = logits[row : row + n]
            row += n
    got = 0 if logits is None else logits.shape[0]
    if row != got:
        raise RuntimeError(f"the forward pass returned {got} logits rows, expected {row}")


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
