"""Plain-torch references for paged attention and the KV cache write (float32 accumulation).

These are the CPU defaults and the oracles the Triton kernels (a later issue) are tested
against. Sequences are flattened ("varlen"): the step's query tokens of every sequence are
concatenated, ``query_start_loc`` marks where each sequence's queries begin. Keys and values
live only in the paged caches and are read through block tables.

Algorithm: PagedAttention (Kwon et al., SOSP 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention"); the reference gathers each sequence's K/V into a
padded batch and runs masked softmax attention, which is exact but not memory efficient.
"""

from __future__ import annotations

import torch


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the step's new keys and values into the paged caches, in place.

    Semantics: ``key_cache.view(-1, H, D)[slot_mapping[t]] = key[t]`` for every token ``t``.

    Args:
        key: ``[T, num_kv_heads, head_dim]`` new keys.
        value: ``[T, num_kv_heads, head_dim]`` new values.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        value_cache: same shape as ``key_cache``.
        slot_mapping: ``[T]`` int64 flat slots (``block_id * block_size + offset``).
    """
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    flat_k.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context.

    Sequence ``b`` has ``q_len = query_start_loc[b+1] - query_start_loc[b]`` queries at
    positions ``[seq_lens[b] - q_len, seq_lens[b])``; query ``i`` attends to key positions
    ``j <= seq_lens[b] - q_len + i`` (and ``j > that - sliding_window`` when a window is set).
    Covers decode (``q_len == 1``), prefill over a cached prefix, and chunked prefill.

    Args:
        query: ``[T, num_heads, head_dim]``.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding this
            step's keys (see :func:`reshape_and_cache_ref`).
        value_cache: same shape as ``key_cache``.
        block_tables: ``[B, max_blocks_per_seq]`` int32/int64 physical block ids (entries past
            a sequence's blocks are ignored).
        seq_lens: ``[B]`` context length of each sequence after this step.
        query_start_loc: ``[B + 1]`` cumulative query counts, ``query_start_loc[-1] == T``.
        scale: Softmax scale, usually ``head_dim ** -0.5``.
        max_query_len: ``max(q_len)`` (a host int, to size the padded batch).
        max_seq_len: ``max(seq_lens)`` (a host int).
        sliding_window: Attend to at most this many most recent positions, None for all.

    Returns:
        ``[T, num_heads, head_dim]`` in ``query``'s dtype (computed in float32).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    batch = seq_lens.shape[0]
    device = query.device
    if num_tokens == 0:
        return query.new_empty(query.shape)
    group = num_heads // num_kv_heads

    seq_lens = seq_lens.to(device=device, dtype=torch.long)
    starts = query_start_loc.to(device=device, dtype=torch.long)
    q_lens = starts[1:] - starts[:-1]
    ctx_lens = seq_lens - q_lens  # position of each sequence's first query

    # Gather K/V of positions [0, max_seq_len) per sequence through the block table.
    kv_pos = torch.arange(max_seq_len, device=device)
    blocks = block_tables.to(device=device, dtype=torch.long)[:, kv_pos // block_size]
    slots = blocks * block_size + kv_pos % block_size  # [B, L]
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    kv_valid = kv_pos[None, :] < seq_lens[:, None]  # [B, L]
    # Slots past a sequence's length may hold anything (even NaN): zero them, since a masked
    # probability of 0 times NaN is still NaN.
    keys = flat_k[slots].float().masked_fill(~kv_valid[:, :, None, None], 0.0)  # [B, L, Hkv, D]
    values = flat_v[slots].float().masked_fill(~kv_valid[:, :, None, None], 0.0)

    # Pad queries to [B, Qmax, H, D].
    q_idx = torch.arange(max_query_len, device=device)
    q_valid = q_idx[None, :] < q_lens[:, None]  # [B, Qmax]
    token_idx = (starts[:-1, None] + q_idx[None, :]).clamp(max=num_tokens - 1)
    queries = query.float()[token_idx]  # [B, Qmax, H, D]

    q_pos = ctx_lens[:, None] + q_idx[None, :]  # [B, Qmax]
    allowed = kv_pos[None, None, :] <= q_pos[:, :, None]  # causal, within the context
    allowed &= kv_valid[:, None, :]
    if sliding_window is not None:
        allowed &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    allowed &= q_valid[:, :, None]
    allowed[:, :, 0] |= ~q_valid  # padded query rows: attend to one key, dropped below

    # [B, Hkv, group, Qmax, D] x [B, Hkv, 1, D, L] -> [B, Hkv, group, Qmax, L]
    qh = queries.view(batch, max_query_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    kh = keys.permute(0, 2, 3, 1).unsqueeze(2)
    scores = torch.matmul(qh, kh) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    vh = values.permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, L, D]
    out = torch.matmul(probs, vh)  # [B, Hkv, group, Qmax, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(batch, max_query_len, num_heads, head_dim)
    return out[q_valid].to(query.dtype)
