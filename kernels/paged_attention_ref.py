"""Plain-torch references for paged attention and the KV cache write (float32 accumulation).

These are the CPU defaults and the oracles the Triton kernels (a later issue) are tested
against. Sequences are flattened ("varlen"): the step's query tokens of every sequence are
concatenated, ``query_start_loc`` marks where each sequence's queries begin. Keys and values
live only in the paged caches and are read through block tables.

Algorithm: PagedAttention (Kwon et al., SOSP 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention"); the reference batches every one-query (decode)
sequence into one padded call, and runs each multi-query (prefill or chunk) sequence on its own
through ``scaled_dot_product_attention`` (a fused, tiled kernel), so a long prefill never pads
the decodes beside it. Float32 throughout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DECODE_GROUP = 16  # decodes batched per call, grouped by context length (16: measured best)


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
        slot_mapping: ``[T]`` int64 flat slots (``block_id * block_size + offset``); a
            negative slot (a padding row of a padded decode step) is skipped, as in the Triton
            kernel. Checking for one reads the slots on the host: this reference is never
            captured in a CUDA graph.
    """
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = (slot_mapping >= 0).nonzero().squeeze(1)
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
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
    logits_soft_cap: float | None = None,
    visible_up_to: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
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
        max_query_len: ``max(q_len)`` (a host int; kernels size their grids with it).
        max_seq_len: ``max(seq_lens)`` (a host int).
        sliding_window: Attend to at most this many most recent positions, None for all.
        logits_soft_cap: Gemma 2's attention soft-capping: scores become
            ``cap * tanh(scores / cap)`` before the softmax; None for none. Computed over
            materialised scores (SDPA has no such option), one sequence at a time.
        visible_up_to: ``[T]`` int64 or None: query ``t`` sees key positions ``j <=
            visible_up_to[t]`` instead of ``j <= its position`` (Gemma 3's bidirectional
            attention within an image's tokens; transformers' ``blockwise_overlay`` OR'ed with
            the causal mask). A sliding window still ends at the query's own position, as
            ``sliding_window_overlay`` AND'ed after the OR. Sequences where it differs from the
            causal bound run one at a time with an explicit mask.
        sinks: ``[num_heads]`` or None: attention sinks (gpt-oss's ``s_aux``): one more logit
            per head in every query's softmax, over no value, so
            ``probs = softmax([scores, sink])[:-1]`` (transformers' eager gpt-oss attention).
            Computed over materialised scores, one sequence at a time, like the soft cap.

    Returns:
        ``[T, num_heads, head_dim]`` in ``query``'s dtype (computed in float32).
    """
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return query.new_empty(query.shape)
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    upper = _non_causal(visible_up_to, starts, lens, q_lens)
    if logits_soft_cap is not None or sinks is not None:
        for b, n in enumerate(q_lens):
            _materialised(query, key_cache, value_cache, block_tables[b], lens[b], starts[b], n,
                          scale, sliding_window, logits_soft_cap, sinks, out,
                          upper.get(b))  # fmt: skip
        return out.to(query.dtype)
    # Decodes sorted by context length and batched in groups of similar length, so a short
    # sequence is not padded to the longest one's context.
    decodes = sorted(
        (b for b, n in enumerate(q_lens) if n == 1 and b not in upper), key=lambda b: lens[b]
    )
    for i in range(0, len(decodes), DECODE_GROUP):
        _decode(
            query,
            key_cache,
            value_cache,
            block_tables,
            lens,
            starts,
            decodes[i : i + DECODE_GROUP],
            scale,
            sliding_window,
            out,
        )
    for b, n in enumerate(q_lens):
        if n > 1 or b in upper:
            _prefill(
                query,
                key_cache,
                value_cache,
                block_tables[b],
                lens[b],
                starts[b],
                n,
                scale,
                sliding_window,
                out,
                upper.get(b),
            )
    return out.to(query.dtype)


def _non_causal(
    visible_up_to: torch.Tensor | None, starts: list[int], lens: list[int], q_lens: list[int]
) -> dict[int, torch.Tensor]:
    """The bounds of the sequences whose queries do not all stop at themselves.

    Returns:
        ``{sequence: [q_len] last visible key position}``, empty when ``visible_up_to`` is None.
    """
    if visible_up_to is None:
        return {}
    device = visible_up_to.device
    seq_of = torch.repeat_interleave(
        torch.arange(len(lens), device=device), torch.tensor(q_lens, device=device)
    )
    first = torch.tensor([n_ctx - n for n_ctx, n in zip(lens, q_lens, strict=True)], device=device)
    offsets = (
        torch.arange(visible_up_to.shape[0], device=device)
        - torch.tensor(starts[:-1], device=device)[seq_of]
    )
    causal = first[seq_of] + offsets
    odd = seq_of[visible_up_to.to(device) != causal].unique().tolist()
    return {b: visible_up_to[starts[b] : starts[b + 1]] for b in odd}


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, Hkv, D]`` float32 entries of positions ``[0, length)`` via a block table.

    Whole blocks are gathered (one ``index_select``) and the tail trimmed: 5x cheaper than
    indexing every position's slot, which dominated a short chunk far into a long context.
    """
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache.index_select(0, table[:num_blocks].to(device=cache.device, dtype=torch.long))
    return blocks.reshape(num_blocks * block_size, cache.shape[2], cache.shape[3])[:length].float()


def _decode(
    query, key_cache, value_cache, block_tables, lens, starts, seqs, scale, window, out
) -> None:
    """One-query sequences at once: whole blocks gathered into ``[B, Hkv, L, D]``.

    ``L`` is the group's longest context rounded up to whole blocks. Positions past a
    sequence's length (the rest of its last block, padding blocks) are masked out of the
    softmax, and their keys and values zeroed first so even a NaN there cannot leak (a NaN
    score survives an additive mask, and 0 * NaN is NaN). The attention itself is
    ``scaled_dot_product_attention`` with grouped-query heads (2x faster here than float32
    matmuls over materialised scores).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    device = query.device
    block_size = key_cache.shape[1]
    batch = len(seqs)
    num_blocks = -(-max(lens[b] for b in seqs) // block_size)
    length = num_blocks * block_size
    idx = torch.tensor(seqs, device=device)
    seq_len = torch.tensor([lens[b] for b in seqs], device=device)
    rows = torch.tensor([starts[b] for b in seqs], device=device)
    tables = block_tables.to(device=device, dtype=torch.long)[idx, :num_blocks].reshape(-1)
    pos = torch.arange(length, device=device)
    valid = pos[None, :] < seq_len[:, None]  # [B, L]
    invalid = (~valid).reshape(-1).nonzero().squeeze(1)

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [B, Hkv, L, D], padding zeroed
        flat = cache.index_select(0, tables).float().view(batch * length, num_kv_heads, head_dim)
        flat = flat.index_fill_(0, invalid, 0.0)
        return flat.view(batch, length, num_kv_heads, head_dim).transpose(1, 2)

    if window is not None:
        valid &= pos[None, :] > seq_len[:, None] - 1 - window
    q = query.index_select(0, rows).float().unsqueeze(2)  # [B, H, 1, D]
    res = F.scaled_dot_product_attention(
        q,
        gather(key_cache),
        gather(value_cache),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )  # [B, H, 1, D]
    out[rows] = res.reshape(batch, num_heads, head_dim)


def _prefill(
    query, key_cache, value_cache, table, length, start, num_q, scale, window, out, upper=None
) -> None:
    """One sequence's ``num_q`` queries at positions ``[length - num_q, length)``.

    ``scaled_dot_product_attention`` with a bottom-right aligned causal mask (query ``i`` sees
    keys ``j <= length - num_q + i``) and grouped-query heads: PyTorch's fused CPU kernel
    computes it in tiles with an online softmax, never materialising the ``[Q, L]`` scores
    (16x faster than doing so for a 2,048-token prompt; the same math, float32 throughout).
    A sliding window needs an explicit mask, which SDPA also takes, and so does ``upper``
    (``[num_q]`` last visible key position of each query, instead of its own position).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    device = query.device
    keys = _gather(key_cache, table, length).permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, L, D]
    values = _gather(value_cache, table, length).permute(1, 0, 2).unsqueeze(0)
    q = query[start : start + num_q].float().permute(1, 0, 2).unsqueeze(0)  # [1, H, Q, D]
    if window is None and upper is None:
        mask = _causal_lower_right(num_q, length, device)
    else:
        mask = _explicit_mask(num_q, length, window, upper, device)
    res = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )  # [1, H, Q, D]
    out[start : start + num_q] = res[0].permute(1, 0, 2).reshape(num_q, num_heads, head_dim)


def _materialised(
    query,
    key_cache,
    value_cache,
    table,
    length,
    start,
    num_q,
    scale,
    window,
    cap,
    sinks,
    out,
    upper=None,
) -> None:
    """One sequence's ``num_q`` queries over materialised scores: soft cap and sinks.

    ``softmax(cap * tanh(q.k * scale / cap) + mask) @ v`` (Gemma 2's attention; no ``tanh``
    when ``cap`` is None), with a sink logit per head appended to each softmax and dropped after
    it when ``sinks`` is given (gpt-oss's); float32, in the order Hugging Face's eager attention
    computes it; grouped-query heads repeat the key/value heads. ``upper`` as in
    :func:`_prefill`.
    """
    if num_q == 0:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    device = query.device
    keys = _gather(key_cache, table, length).permute(1, 0, 2)  # [Hkv, L, D]
    values = _gather(value_cache, table, length).permute(1, 0, 2)
    groups = num_heads // keys.shape[0]
    keys = keys.repeat_interleave(groups, dim=0)  # [H, L, D]
    values = values.repeat_interleave(groups, dim=0)
    q = query[start : start + num_q].float().permute(1, 0, 2)  # [H, Q, D]
    scores = torch.matmul(q, keys.transpose(1, 2)) * scale  # [H, Q, L]
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    mask = _explicit_mask(num_q, length, window, upper, device)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(device=device, dtype=torch.float32).view(-1, 1, 1).expand(-1, num_q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    res = torch.matmul(probs, values)  # [H, Q, D]
    out[start : start + num_q] = res.permute(1, 0, 2).reshape(num_q, num_heads, head_dim)


def _explicit_mask(
    num_q: int, length: int, window: int | None, upper: torch.Tensor | None, device
) -> torch.Tensor:
    """``[num_q, length]`` bool attention mask.

    Query ``i`` (position ``p = length - num_q + i``) sees key ``j`` when ``j <= upper[i]``
    (``p`` when ``upper`` is None) and, with a window, ``j > p - window``.
    """
    q_pos = torch.arange(length - num_q, length, device=device)
    k_pos = torch.arange(length, device=device)
    last = q_pos if upper is None else upper.to(device=device, dtype=q_pos.dtype)
    mask = k_pos[None, :] <= last[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def _causal_lower_right(num_q: int, length: int, device: torch.device) -> torch.Tensor | None:
    """The bottom-right aligned causal mask of ``num_q`` queries over ``length`` keys.

    None when ``num_q == length`` (then SDPA's own ``is_causal=True``, the same mask). On CPU
    otherwise the ``[Q, L]`` bool mask, exactly what ``torch.nn.attention.bias.CausalBias``
    materialises there (no CPU kernel takes a lower-right variant); elsewhere ``CausalBias``
    itself (flash attention's lower-right causal on CUDA). That module is imported only then:
    importing it loads ``torch._dynamo`` (1.5 s, and triton with it).
    """
    if num_q == length:
        return None
    if device.type == "cpu":
        return torch.ones(num_q, length, dtype=torch.bool, device=device).tril(length - num_q)
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(num_q, length)
