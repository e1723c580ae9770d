"""Split-KV (Flash-Decoding) support for :mod:`kernels.triton_attention`: choose, then merge.

With ``S`` splits, split ``s`` of a query row attends over its own contiguous range of cache
tiles and leaves a normalized partial output ``o_s`` and its log-sum-exp ``lse_s`` (base 2).
The exact result is the softmax-weighted mix of the partials::

    m = max_s lse_s,   w_s = 2 ** (lse_s - m),   out = sum_s w_s * o_s / sum_s w_s

A split that saw no position has ``lse_s = -inf`` (weight 0) and ``o_s = 0``.

Source: Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference" (2023).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

MAX_SPLITS = 64
MIN_TILES_PER_SPLIT = 4
PROGRAMS_PER_SM = 8  # decode streams K/V: enough programs in flight to cover memory latency


@triton.jit
def _merge_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    stride_pt,
    stride_ps,
    stride_ph,
    stride_lt,
    stride_ls,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + tok * stride_lt + offs_s * stride_ls + head)
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [S]
    part = tl.load(
        partial_ptr
        + tok * stride_pt
        + offs_s[:, None] * stride_ps
        + head * stride_ph
        + offs_d[None, :],
        mask=d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Merge split-KV partial outputs into ``out``, in place.

    Args:
        partial: ``[T, S, H, D]`` float32 normalized partial outputs (S a power of two).
        lse: ``[T, S, H]`` float32 base-2 log-sum-exp of each partial (``-inf``: empty split).
        out: ``[T, H, D]`` destination (any float dtype, last dim contiguous).

    Returns:
        ``out``.
    """
    num_tokens, num_splits, num_heads, head_dim = partial.shape
    if num_tokens == 0:
        return out
    _merge_kernel[(num_tokens, num_heads)](
        partial,
        lse,
        out,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        NUM_SPLITS=num_splits,
    )
    return out


def merge_splits_ref(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Plain-torch float32 reference of :func:`merge_splits`: ``[T, S, H, D] -> [T, H, D]``."""
    m = lse.max(dim=1, keepdim=True).values
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp2(lse - m)  # [T, S, H]
    total = w.sum(dim=1)
    mixed = (partial.float() * w[..., None]).sum(dim=1)
    return mixed / torch.where(total > 0, total, torch.ones_like(total))[..., None]


@lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_kv_splits(
    num_programs: int,
    max_query_len: int,
    max_seq_len: int,
    tile: int,
    device: torch.device,
) -> int:
    """How many KV splits a launch should use (a power of two, 1 = no split).

    Splits only decode-only steps on a GPU, and only when the unsplit launch has fewer than
    ``PROGRAMS_PER_SM`` programs per SM: a decode program streams its sequence's K/V and the
    memory system needs many such streams in flight. Enough splits to get there, each still
    covering at least ``MIN_TILES_PER_SPLIT`` tiles of keys, at most ``MAX_SPLITS``. The
    constants come from ``bench.kernel_tuning`` on an H200 (docs/gpu.md): at Llama-3-8B's
    attention this picks the fastest measured split count at 6 of 7 decode shapes (batch 1 at
    32k: 64 splits, 0.53 of the copy bandwidth against 0.04 unsplit; batch 64 at 2k-4k: 2;
    batch 256: none), and 8 at batch 16 x 2k where 2 measured faster.

    Args:
        num_programs: Programs of the unsplit launch that have work (sequences times KV heads
            for a decode step).
        max_query_len: Longest query run in the step (splitting is for decodes: 1).
        max_seq_len: Longest context in the step.
        tile: Key positions per tile of the attention kernel.
        device: Where the launch runs (CPU, i.e. the interpreter, never splits).
    """
    if device.type != "cuda" or max_query_len != 1:
        return 1
    target = PROGRAMS_PER_SM * _num_sms(device.index if device.index is not None else 0)
    if num_programs >= target:
        return 1
    by_tiles = max(1, -(-max_seq_len // tile) // MIN_TILES_PER_SPLIT)
    want = min(MAX_SPLITS, by_tiles, -(-target // max(num_programs, 1)))
    return 1 << (want.bit_length() - 1)  # round down to a power of two
