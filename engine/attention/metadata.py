"""Per-step attention metadata: how the flattened tokens of a step map onto the paged cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """What every attention layer of one step needs, built once per step by the model runner.

    The step's tokens are flattened across sequences (prefill chunks and decodes mixed), in
    the order of the sequences: sequence ``b`` owns tokens
    ``[query_start_loc[b], query_start_loc[b + 1])``.

    Attributes:
        slot_mapping: ``[T]`` int64: the flat KV slot each new token's K/V is written to.
        query_start_loc: ``[B + 1]`` int32 cumulative query counts.
        seq_lens: ``[B]`` int32 context length of each sequence after this step (cached
            tokens + this step's tokens).
        block_tables: ``[B, max_blocks_per_seq]`` int32 physical block ids (0-padded).
        max_query_len: Host int, ``max`` of the query lengths.
        max_seq_len: Host int, ``max(seq_lens)``.
        num_decode_tokens: Host int: sequences with exactly one query (informational; lets a
            backend pick a decode kernel).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_decode_tokens: int = 0

    @property
    def num_seqs(self) -> int:
        """Sequences in the step (``B``)."""
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens in the step (``T``)."""
        return int(self.slot_mapping.shape[0])
