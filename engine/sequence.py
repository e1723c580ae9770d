"""The scheduler's view of a generation stream: tokens, KV progress, status, finish.

A request with ``n > 1`` runs as one sequence until its prompt is computed; the step that
samples its first token forks it into ``n`` sequences that share every prompt block (copy on
write of the partial last block), each then decoding on its own.

Only the scheduler writes a :class:`Sequence` (``engine.scheduling``: ``update_from_output``,
through its ``OutputApplier``, appends tokens and decides finishes; the scheduler's transitions
move it between queues); the model runner keeps its own per-sequence state from what
``SchedulerOutput`` tells it, and the client side sees only ``EngineCoreOutput``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.request import EngineRequest
from loraplex.hashing.request_hasher import RequestBlockHasher


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed (recompute) or KV in the CPU pool (swap)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generation stream: the unit the scheduler admits, runs, preempts and finishes.

    Attributes:
        seq_id: ``request_id`` for the first sequence, ``request_id#i`` for forks.
        request: The request it belongs to.
        index: Output index within the request (``0 .. n-1``).
        token_ids: Prompt + generated tokens.
        hasher: Block hashes of ``token_ids`` (full blocks), extended as tokens arrive.
        num_computed_tokens: Tokens whose KV is in the sequence's blocks.
        status: Waiting, running, preempted or finished.
        num_cached_tokens: Prompt tokens served from the prefix cache at first admission.
        swapped: True while its KV lives in the CPU swap pool.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` once finished.
        stop_reason: The stop token id or stop string that finished it, if any.
        known_to_runner: The model runner holds state for it (sent once as a ``NewSeq``,
            dropped at preemption and finish).
        first_scheduled_time: ``time.monotonic()`` when the scheduler first admitted it from
            the waiting queue (a re-admission after preemption does not move it).
        grammar: Its structured-output matcher (llguidance ``LLMatcher``, advanced by every
            token it appends), or None for free text.
        spec_token_ids: Speculative decoding: the proposer's tokens to follow its last one
            (from the last step's ``ModelRunnerOutput``); empty when none.
        spec: Its adaptive proposal count (``engine.spec_decode.AdaptiveK``), None while it
            has not speculated.
        prompt_logprobs: The prompt logprobs gathered so far, chunk by chunk (prompt tokens
            ``1 .. len``), while the request's first sequence still owes them; None when not
            asked, in a fork child, and once delivered. While it is a list the sequence takes
            no prefix-cache hits (docs/engine.md, *Prompt logprobs*).
    """

    seq_id: str
    request: EngineRequest
    index: int
    token_ids: list[int]
    hasher: RequestBlockHasher
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int | None = None
    swapped: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    known_to_runner: bool = False
    first_scheduled_time: float | None = None
    grammar: Any = None
    spec_token_ids: list[int] = field(default_factory=list)
    spec: Any = None
    prompt_logprobs: list | None = None

    def __post_init__(self) -> None:
        if self.index == 0 and self.request.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens."""
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens."""
        return len(self.token_ids) - len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        """True once finished (stop, length, abort or error)."""
        return self.status is SequenceStatus.FINISHED
