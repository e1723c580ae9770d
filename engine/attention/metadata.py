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
        visible_up_to: ``[T]`` int64 or None: the last key position each query may see, for a
            step in which some queries see past themselves (the tokens of one image, attended
            bidirectionally: Gemma 3); None means causal (each query sees up to its own
            position). Sliding windows still apply from the query's own position.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_decode_tokens: int = 0
    visible_up_to: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        """Sequences in the step (``B``)."""
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens in the step (``T``)."""
        return int(self.slot_mapping.shape[0])


@dataclass(frozen=True, slots=True)
class StepInputs:
    """A forward pass's flattened inputs: token ids, positions, and the attention metadata.

    Attributes:
        input_ids: ``[T]`` int64 token ids.
        positions: ``[T]`` int64 positions.
        metadata: The attention metadata.
        query_start: ``B + 1`` host ints: chunk ``b`` owns rows ``[query_start[b],
            query_start[b + 1])``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    query_start: list[int]


def step_inputs(chunks, device: torch.device) -> StepInputs:
    """Flatten query chunks into one forward pass's inputs.

    Args:
        chunks: ``B`` triples ``(token_ids, start, table)``: the tokens computed at positions
            ``start ..`` of one sequence, and its block table (``engine.kv_cache.BlockTable``,
            covering every one of those positions).
        device: Where the tensors go.

    Returns:
        The :class:`StepInputs`.

    Raises:
        IndexError: a chunk reaches past its table.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start = [0]
    tables: list[list[int]] = []
    for token_ids, start, table in chunks:
        end = start + len(token_ids)
        input_ids.extend(token_ids)
        positions.extend(range(start, end))
        slots.extend(table.slot_mapping(start, end))
        seq_lens.append(end)
        query_start.append(query_start[-1] + len(token_ids))
        tables.append(table.block_ids)
    max_blocks = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        max_query_len=max(b - a for a, b in zip(query_start, query_start[1:], strict=False)),
        max_seq_len=max(seq_lens),
        num_decode_tokens=sum(
            1 for a, b in zip(query_start, query_start[1:], strict=False) if b - a == 1
        ),  # fmt: skip
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        metadata=meta,
        query_start=query_start,
    )
