"""Draft-model proposals: a smaller checkpoint with the target's vocabulary, run in the step.

Speculative sampling with a draft model (Leviathan et al. 2023; Chen et al. 2023) inside the
continuous batch, the way vLLM's draft-model method runs it: the scheduler gives a speculating
sequence ``k`` lookahead slots, and at the start of the step the draft proposes its ``k``
tokens greedily, ``k`` draft forwards in all, before the target's one forward verifies them
(``engine.spec_decode.verify``).

The draft's KV lives in a paged pool of its own with the target's block ids: the same block
tables and slot mappings index both, so copy on write and the sequence's own blocks need no
bookkeeping of their own. Each sequence remembers how far its draft KV is valid
(``draft_len``, 0 for a sequence the runner has just been sent, since a prefix-cache hit or a
swap-in brings target KV only), and the draft runs only for the sequences that speculate in
the step: its first forward computes each one's positions from ``draft_len`` through its last
real token (the whole prompt the first time, then the one or two tokens the last step left),
which yields the first proposals; each further forward feeds one proposal per speculating
sequence. The catch-up of one step is bounded (``max_catch_up_tokens``, the step's token
budget), so long prompts starting to speculate together cannot make one step's draft pass
unbounded: a sequence whose catch-up does not fit gets what is left of the bound, runs the
step as a plain decode, and reports itself ``undrafted`` (no acceptance is counted for it).
Positions written with a proposal the target later rejects fall past ``draft_len`` and are
written again before they are read. A step where nobody speculates (the adaptive count is 0
everywhere) does not run the draft at all.

The draft only proposes: a draft that is wrong, stale or slow costs acceptance, never
correctness. It runs without the request's LoRA adapter and sees image placeholder tokens as
plain tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.engine.attention.metadata import step_inputs
from loraplex.engine.kv_cache.block_table import BlockTable
from loraplex.engine.kv_cache.profile import pool_zeros

logger = logging.getLogger(__name__)


def check_draft(draft: Any, target: Any, max_model_len: int) -> None:
    """Refuse a draft that cannot propose for the target.

    Raises:
        ValueError: a multimodal draft, another vocabulary size (a different tokenizer), or
            fewer positions than the target's ``max_model_len``.
    """
    if hasattr(draft, "encode_images"):
        raise ValueError("the draft model must be a text-only (Llama-family) checkpoint")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.vocab_size}) is not the target's "
            f"({target.vocab_size}): it must share the target's tokenizer"
        )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"the draft model has {draft.max_position_embeddings} positions, fewer than "
            f"max_model_len {max_model_len}"
        )


@dataclass(frozen=True, slots=True)
class DraftInput:
    """What the draft model reads of one speculating sequence in a step (the runner builds it).

    Read only: the draft writes neither.

    Attributes:
        token_ids: The sequence's tokens, at least through its last real token (position
            ``item.start``).
        table: Its block table (``engine.kv_cache.BlockTable``), covering the step's
            ``1 + k`` positions: the draft's pool is indexed by the same block ids.
    """

    token_ids: Sequence[int]
    table: BlockTable


class DraftProposer:
    """Runs the draft model over the step and proposes each speculating sequence's tokens.

    Args:
        model: The draft model (``engine.models`` Llama family, text only).
        num_kv_blocks: Blocks of the target's pool (the draft's pool has as many).
        block_size: Tokens per block.
        backend: The attention backend.
        device: Where the draft runs.
        dtype: Its KV dtype.
        max_catch_up_tokens: Most tokens the first draft forward of a step computes.

    Attributes:
        kv_caches: ``num_layers`` (K, V) pairs of ``[num_blocks, block_size, kv_heads,
            head_dim]``, indexed by the target's block ids.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_kv_blocks: int,
        block_size: int,
        backend: Any,
        device: torch.device,
        dtype: torch.dtype,
        max_catch_up_tokens: int = 2048,
    ) -> None:
        self.model = model
        self.max_catch_up_tokens = max_catch_up_tokens
        self.backend = backend
        self.device = device
        shape = (num_kv_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (pool_zeros(shape, dtype, device), pool_zeros(shape, dtype, device))
            for _ in range(model.num_layers)
        ]
        self.draft_len: dict[str, int] = {}  # seq_id -> positions with valid draft KV

    def drop(self, seq_id: str) -> None:
        """Forget a finished or preempted sequence."""
        self.draft_len.pop(seq_id, None)

    @torch.inference_mode()
    def fill(self, items: list[Any], inputs: Mapping[str, DraftInput]) -> list[Any]:
        """Draft the proposals of the step's speculating sequences.

        Args:
            items: The step's ``ScheduledSeq``s; those with ``num_draft_tokens = k > 0`` have
                ``1 + k`` positions scheduled and get ``k`` proposals.
            inputs: ``seq_id -> DraftInput`` for each of those.

        Returns:
            ``items`` with ``spec_token_ids`` filled in where drafted (copies; the others as
            they were). A speculating item left undrafted (its catch-up did not fit the
            step's bound, or the draft forward raised) comes back as a plain decode
            (``num_new_tokens = 1``, no proposals; ``num_draft_tokens`` kept, so its lookahead
            slots are still given back).
        """
        try:
            proposals = self._propose(items, inputs)
        except Exception:
            logger.exception("the draft model failed; this step does not speculate")
            proposals = {}
        return [
            item
            if not item.num_draft_tokens
            else dataclasses.replace(item, spec_token_ids=proposals[item.seq_id])
            if item.seq_id in proposals
            else dataclasses.replace(item, num_new_tokens=1)
            for item in items
        ]

    def _propose(self, items: list[Any], inputs: Mapping[str, DraftInput]) -> dict[str, list[int]]:
        chunks, rows, drafting, reached = [], [], [], {}
        row, room = 0, self.max_catch_up_tokens
        for item in items:
            if not item.num_draft_tokens or room <= 0:
                continue
            st = inputs[item.seq_id]
            begin = min(self.draft_len.get(item.seq_id, 0), item.start)
            end = min(item.start + 1, begin + room)
            chunks.append((st.token_ids[begin:end], begin, st.table))
            row += end - begin
            room -= end - begin
            reached[item.seq_id] = end
            if end == item.start + 1:  # caught up: its last token's logits propose
                rows.append(row - 1)
                drafting.append(item)
        proposals: dict[str, list[int]] = {item.seq_id: [] for item in drafting}
        next_ids = self._forward(chunks, rows)
        self.draft_len.update(reached)  # written only once the forward has run
        for step in range(1, max((i.num_draft_tokens for i in drafting), default=0) + 1):
            for item, token in zip(drafting, next_ids, strict=True):
                proposals[item.seq_id].append(token)
            drafting = [i for i in drafting if i.num_draft_tokens > step]
            if not drafting:
                break
            chunks = [
                ([proposals[i.seq_id][-1]], i.start + step, inputs[i.seq_id].table)
                for i in drafting
            ]
            next_ids = self._forward(chunks, list(range(len(drafting))))
        return proposals

    def _forward(self, chunks: list[tuple], rows: list[int]) -> list[int]:
        """One draft forward over ``chunks``; the argmax token at each of ``rows``."""
        if not chunks:
            return []
        inputs = step_inputs(chunks, self.device)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, self.backend
        )
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, index)).argmax(-1).tolist()

    def verified(self, seq_id: str, start: int, num_drafted: int, num_kept: int) -> None:
        """After verification: the draft KV is valid through the last kept proposal it wrote.

        An undrafted step (``num_drafted == 0``: its catch-up did not reach ``start``, or the
        draft forward failed) wrote nothing past the catch-up, whose ``draft_len`` stands.

        Args:
            seq_id: The sequence.
            start: The step's first position (its last real token).
            num_drafted: Proposals drafted (``k``); the draft wrote positions
                ``start .. start + k - 1``.
            num_kept: Tokens the step kept (``a + 1``).
        """
        if num_drafted:
            self.draft_len[seq_id] = min(start + num_drafted, start + num_kept)
