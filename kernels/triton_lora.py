"""The Triton programs behind :mod:`kernels.lora_ops` (Punica SGMV shrink and expand).

Grids (``P`` token blocks of :class:`kernels.lora_ops.LoRABatch`, ``S`` fused slices)::

    shrink grid (P, cdiv(max_rank, BLOCK_R), S * SPLIT_K):
        h[k, t, r] = sum_i x[t, i] * A_k[s, r, i]
    expand grid (P, cdiv(max_k out_k, BLOCK_N), S):
        y[t, off_k + n] += scale_k[s] * sum_r h[k, t, r] * B_k[s, n, r]

A block's rows are ``sorted_tokens[start : min(start + BLOCK_M, end)]``, all of one slot ``s``.
With ``MULTI`` the slice's weights come from a table of device pointers (expand: pointer,
column offset, width, slot stride per slice); ``HAS_RANKS`` bounds the loads by each slot's
rank; ``DOT_F32`` upcasts the dot operands (float32 inputs, and the interpreter, whose
bfloat16 dot is wrong). Accumulation is always float32.
"""

import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    a_table_ptr,
    h_ptr,
    sorted_ptr,
    blocks_ptr,
    ranks_ptr,
    in_features,
    max_rank,
    stride_xt,
    stride_al,
    stride_ar,
    stride_hs,
    stride_ht,
    stride_rs,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    MULTI: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Shrink one token block of one slot: ``h[k, rows, r_tile] = x[rows] @ A_k[s].T``."""
    pb = tl.program_id(0)
    r_tile = tl.program_id(1)
    slice_id = tl.program_id(2) // SPLIT_K
    k_split = tl.program_id(2) % SPLIT_K
    slot = tl.load(blocks_ptr + pb * 3).to(tl.int64)
    start = tl.load(blocks_ptr + pb * 3 + 1)
    end = tl.load(blocks_ptr + pb * 3 + 2)
    if end <= start:  # an empty block (a CUDA graph's spare programs): no rows
        return
    rank = max_rank
    if HAS_RANKS:
        rank = tl.load(ranks_ptr + slice_id * stride_rs + slot)
    a_base = a_ptr
    if MULTI:
        a_base = tl.load(a_table_ptr + slice_id).to(tl.pointer_type(a_ptr.dtype.element_ty))
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tok = tl.load(sorted_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    offs_r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    r_ok = offs_r < rank
    # A tile wholly past the slot's rank reads nothing and stores zeros.
    k_end = in_features
    if r_tile * BLOCK_R >= rank:
        k_end = 0
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_split * BLOCK_K, k_end, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_ok = offs_k < in_features
        x = tl.load(
            x_ptr + tok[:, None] * stride_xt + offs_k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        a = tl.load(
            a_base + slot * stride_al + offs_r[None, :] * stride_ar + offs_k[:, None],
            mask=r_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]: A[slot].T
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a.to(x.dtype))
    h_ptrs = h_ptr + slice_id * stride_hs + tok[:, None] * stride_ht + offs_r[None, :]
    h_mask = row_ok[:, None] & (offs_r < max_rank)[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(h_ptrs, acc, mask=h_mask)
    else:
        tl.store(h_ptrs, acc, mask=h_mask)


@triton.jit
def lora_expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    b_table_ptr,
    scales_ptr,
    sorted_ptr,
    blocks_ptr,
    ranks_ptr,
    col_offset,
    out_width,
    stride_bl,
    max_rank,
    stride_yt,
    stride_hs,
    stride_ht,
    stride_bn,
    stride_ss,
    stride_rs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MULTI: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Expand one token block: ``y[rows, off_k + n_tile] += scale * h[k, rows] @ B_k[s].T``."""
    pb = tl.program_id(0)
    n_tile = tl.program_id(1)
    slice_id = tl.program_id(2)
    b_base = b_ptr
    if MULTI:  # table row: (pointer, column offset, width, slot stride)
        row = b_table_ptr + slice_id * 4
        b_base = tl.load(row).to(tl.pointer_type(b_ptr.dtype.element_ty))
        col_offset = tl.load(row + 1)
        out_width = tl.load(row + 2)
        stride_bl = tl.load(row + 3)
    if n_tile * BLOCK_N >= out_width:
        return
    slot = tl.load(blocks_ptr + pb * 3).to(tl.int64)
    start = tl.load(blocks_ptr + pb * 3 + 1)
    end = tl.load(blocks_ptr + pb * 3 + 2)
    if end <= start:  # an empty block (a CUDA graph's spare programs): no rows
        return
    rank = max_rank
    if HAS_RANKS:
        rank = tl.load(ranks_ptr + slice_id * stride_rs + slot)
    scale = tl.load(scales_ptr + slice_id * stride_ss + slot).to(tl.float32)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tok = tl.load(sorted_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    n_ok = offs_n < out_width
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_K):
        offs_r = r0 + tl.arange(0, BLOCK_K).to(tl.int64)
        r_ok = offs_r < rank
        h = tl.load(
            h_ptr + slice_id * stride_hs + tok[:, None] * stride_ht + offs_r[None, :],
            mask=row_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_base + slot * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None],
            mask=n_ok[None, :] & r_ok[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: B[slot].T
        if DOT_F32:
            acc += tl.dot(h.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(h.to(b.dtype), b)
    y_ptrs = y_ptr + tok[:, None] * stride_yt + col_offset + offs_n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + scale * acc).to(y_ptr.dtype.element_ty), mask=mask)
