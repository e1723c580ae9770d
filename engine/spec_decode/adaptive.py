"""How many proposals a sequence verifies next, from its own acceptance so far; the counters.

Verifying a proposal costs a position of the forward pass whether or not it is accepted, so
speculation only pays while proposals are accepted. Each sequence keeps a decayed estimate of
its per-token acceptance probability ``alpha`` (the maximum-likelihood estimate of a geometric
run: accepted tokens over accepted tokens plus rejections, both decayed by ``DECAY`` per
verification). The ``k``-th proposal is accepted with probability about ``alpha**k``; the
controller verifies the largest ``k <= max_k`` with ``alpha**k >= MIN_GAIN``. When that is 0,
speculation stops for a back-off of 1, 2, 4 ... 64 of the sequence's proposal steps, then a
single proposal probes whether acceptance came back. A sequence whose output never repeats
therefore verifies about one proposal in 64 steps, so n-gram speculation costs it next to
nothing (``bench.speculative``'s non-repeating workload); vLLM has no such control (a fixed
``k``).

A draft model is different: before it can propose for a sequence it must have seen every
token of it (``engine.spec_decode.draft``), so each probe costs a draft pass over everything
since the last one, and probing at any rate costs about the draft's share of the target's
work per token. With ``max_failed_probes`` (the draft method uses ``DRAFT_MAX_FAILED_PROBES``)
a sequence whose probes all fail that many times in a row stops speculating for good.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_GAIN = 0.25
"""The ``k``-th proposal is verified only while ``alpha**k`` is at least this."""

DECAY = 0.8
"""Weight of the past in the acceptance estimate, per verification."""

MAX_BACKOFF = 64
"""Most proposal steps a sequence skips between probes."""

DRAFT_MAX_FAILED_PROBES = 3
"""Draft model: failed probes in a row after which a sequence stops speculating."""


@dataclass
class AdaptiveK:
    """One sequence's proposal count controller.

    Args:
        max_k: The server's ``--num-speculative-tokens``.
        max_failed_probes: Failed probes in a row after which :meth:`next_k` is 0 for good;
            None: probe forever.

    Attributes:
        accepted: Decayed count of accepted proposals.
        rejected: Decayed count of rejections (at most one per verification).
        wait: Proposal steps left to skip.
        backoff: The next back-off, in proposal steps.
        failed_probes: Probes in a row that were rejected.
    """

    max_k: int
    max_failed_probes: int | None = None
    accepted: float = 1.0  # a prior of alpha = 0.5: start at k = 2, grow from there
    rejected: float = 1.0
    wait: int = 0
    backoff: int = 1
    failed_probes: int = 0
    _probing: bool = False

    @property
    def alpha(self) -> float:
        """The estimated per-token acceptance probability."""
        return self.accepted / (self.accepted + self.rejected)

    def next_k(self) -> int:
        """How many proposals to verify at this step (call once per step with proposals)."""
        if self.max_failed_probes is not None and self.failed_probes >= self.max_failed_probes:
            return 0
        if self.wait > 0:
            self.wait -= 1
            return 0
        k, gain, alpha = 0, 1.0, self.alpha
        while k < self.max_k and gain * alpha >= MIN_GAIN:
            gain *= alpha
            k += 1
        if k == 0:  # not worth it: probe one proposal, then back off if it fails
            self.wait = self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
            self._probing = True
            return min(1, self.max_k)
        self.backoff = 1
        self._probing = False
        return k

    def update(self, num_proposed: int, num_accepted: int) -> None:
        """Record one verification: ``num_accepted`` of ``num_proposed`` proposals kept."""
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejected = DECAY * self.rejected + (num_accepted < num_proposed)
        if self._probing:
            self.failed_probes = self.failed_probes + 1 if num_accepted == 0 else 0


@dataclass
class SpecDecodeStats:
    """Engine-wide acceptance counters (vLLM's ``spec_decode_*`` metrics).

    Attributes:
        num_drafts: Verifications (steps of a sequence with at least one proposal).
        num_draft_tokens: Proposed tokens verified.
        num_accepted_tokens: Proposed tokens accepted.
        accepted_per_pos: ``[k]``: accepted proposals at each position (0 = first).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """Count one verification."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_proposed:
            self.accepted_per_pos.extend([0] * (num_proposed - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict[str, object]:
        """The counters for ``EngineCore.stats()``."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }
