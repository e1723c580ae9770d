"""Triton paged attention: one kernel for decode, prefill and chunked prefill over block tables.

Each program owns ``BLOCK_M`` query rows of one sequence and one KV head: ``BLOCK_Q`` consecutive
query tokens times the ``GROUP`` query heads that share the KV head (GQA), flattened::

    row m  ->  token  q_block * BLOCK_Q + m // GROUP,   head  kv_head * GROUP + m % GROUP

It walks the sequence's context in tiles of ``TILE_N`` positions (``TILE_N // BLOCK_SIZE``
cache blocks, each found through the block table), from the first position the sliding window
can see to the last position causality allows for its rows, keeping a FlashAttention-2 online
softmax (running max and sum in float32, base-2 exponentials). Query ``i`` of a sequence with
``q_len`` queries and ``seq_len`` positions sits at position ``seq_len - q_len + i`` and sees
key ``j`` iff ``j <= that`` (and ``j > that - window`` with a sliding window, Mistral semantics
as in :func:`kernels.paged_attention_ref.paged_attention_ref`).

Programs are laid out without a host round trip (vLLM's unified-attention trick): sequence ``b``
owns program ids ``[qsl[b] // BLOCK_Q + b, ...)``, so ``T // BLOCK_Q + B`` programs cover every
sequence; each finds its sequence by binary search over ``query_start_loc`` and the spare ones
return at once.

Split-KV (Flash-Decoding): with ``num_splits > 1`` the tiles of each program are cut into
``num_splits`` contiguous ranges run by separate programs, each writing a normalized partial
output and its log-sum-exp (base 2) in float32; :mod:`kernels.triton_split_kv` merges them. It
pays off for long contexts at small batch, where one program per (sequence, KV head) leaves most
of the GPU idle.

Sources: Kwon et al., "PagedAttention" (SOSP 2023); Dao, "FlashAttention-2" (2023); Dao et al.,
"Flash-Decoding for long-context inference" (2023); vLLM's ``triton_unified_attention.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.triton_split_kv import merge_splits, num_kv_splits

LOG2E = 1.4426950408889634
TILE_N = 64  # key positions per tile (whole cache blocks; at least one block)
PREFILL_BLOCK_M = 64  # query rows (tokens x heads of a KV group) per program, steps with prefill
# Triton launch options (num_warps, num_stages) per kind of step; empty: Triton's defaults.
# bench.kernel_tuning measures the alternatives on a GPU (docs/gpu.md).
DECODE_LAUNCH: dict[str, int] = {}
PREFILL_LAUNCH: dict[str, int] = {}


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    lse_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_seqs,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_os,
    stride_oh,
    stride_lt,
    stride_ls,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The sequence whose programs start at or before this one: binary search.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    context = seq_len - q_len

    # int64 offsets: no int32 overflow on large caches (and no overflow checks when interpreted).
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    offs_n = tl.arange(0, TILE_N).to(tl.int64)
    q_idx = local * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    q_pos = context + q_idx
    tok = q_start + q_idx
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    # Positions this program's rows can see: [lo_pos, hi_pos).
    hi_pos = tl.minimum(seq_len, context + (local + 1) * BLOCK_Q)
    lo_pos = 0
    if USE_WINDOW:
        lo_pos = tl.maximum(context + local * BLOCK_Q - window + 1, 0)
    tile_lo = lo_pos // TILE_N
    tile_hi = (hi_pos + TILE_N - 1) // TILE_N
    if NUM_SPLITS > 1:
        per_split = (tile_hi - tile_lo + NUM_SPLITS - 1) // NUM_SPLITS
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + offs_n
        k_ok = k_pos < seq_len
        # TILE_N // BLOCK_SIZE cache blocks per tile, each looked up in the block table.
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_cache_ptr
            + (block * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh)[:, None]
            + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + (block * stride_vb + (k_pos % BLOCK_SIZE) * stride_vs + kv_head * stride_vh)[:, None]
            + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = s * scale_log2
        allowed = k_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_ptrs = (
        out_ptr + tok[:, None] * stride_ot + split * stride_os + head[:, None] * stride_oh
    ) + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if NUM_SPLITS > 1:
        has = l_i > 0.0
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + tok * stride_lt + split * stride_ls + head, lse, mask=row_ok)


def _interpreted() -> bool:
    """Whether the kernels were decorated under ``TRITON_INTERPRET=1`` (CPU tensors work)."""
    return type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def paged_attention(
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
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context (Triton).

    Same semantics and arguments as :func:`kernels.paged_attention_ref.paged_attention_ref`
    (decode, prefill over a cached prefix and chunked prefill in one launch), computed with
    float32 accumulation.

    Args:
        query: ``[T, num_heads, head_dim]`` float32/float16/bfloat16 (last dim contiguous).
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` holding this step's keys
            (``block_size`` a power of two).
        value_cache: same shape and dtype as ``key_cache``.
        block_tables: ``[B, max_blocks_per_seq]`` int32 physical block ids.
        seq_lens: ``[B]`` int32 context length of each sequence after this step.
        query_start_loc: ``[B + 1]`` int32 cumulative query counts.
        scale: Softmax scale.
        max_query_len: ``max(q_len)`` (host int): 1 selects decode tiling.
        max_seq_len: ``max(seq_lens)`` (host int): sizes the split-KV choice.
        sliding_window: Attend to at most this many most recent positions, None for all.
        num_splits: KV splits per program (a power of two); None picks one from the shape and
            the device (1 on CPU).
        out: Optional ``[T, num_heads, head_dim]`` output in ``query``'s dtype.

    Returns:
        ``[T, num_heads, head_dim]`` in ``query``'s dtype.

    Raises:
        ValueError: heads not a multiple of KV heads, a bad split count, or a mismatched cache.
        RuntimeError: CPU tensors while the kernels are not interpreted (set
            ``TRITON_INTERPRET=1`` before importing them).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = key_cache.shape
    if num_heads % num_kv_heads or cache_dim != head_dim or value_cache.shape != key_cache.shape:
        raise ValueError("query heads must be a multiple of the cache's KV heads, same head_dim")
    if query.device.type != "cuda" and not _interpreted():
        raise RuntimeError("Triton on CPU needs TRITON_INTERPRET=1 set before importing kernels")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} with a contiguous head_dim")
    if num_tokens == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("the caches' head_dim must be contiguous")
    group = num_heads // num_kv_heads
    tile_n = max(TILE_N, block_size)
    block_m = max(16 if max_query_len == 1 else PREFILL_BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group
    num_seqs = seq_lens.shape[0]
    grid_q = num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = num_kv_splits(
            num_seqs * num_kv_heads, max_query_len, max_seq_len, tile_n, query.device
        )
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    dot_f32 = query.dtype == torch.float32 or _interpreted()
    if num_splits > 1:
        target = torch.empty(
            (num_tokens, num_splits, num_heads, head_dim), dtype=torch.float32, device=query.device
        )
        lse = torch.empty(
            (num_tokens, num_splits, num_heads), dtype=torch.float32, device=query.device
        )
    else:
        target = out.unsqueeze(1)  # [T, 1, H, D]
        lse = target  # unused
    _paged_attention_kernel[(grid_q, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        target,
        lse,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * LOG2E,
        num_seqs,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        target.stride(0),
        target.stride(1),
        target.stride(2),
        lse.stride(0),
        lse.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        DOT_F32=dot_f32,
        **(DECODE_LAUNCH if max_query_len == 1 else PREFILL_LAUNCH),
    )
    if num_splits > 1:
        merge_splits(target, lse, out)
    return out
