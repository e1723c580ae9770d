"""Triton ``reshape_and_cache``: write a step's new K/V into the paged caches via the slot mapping.

Semantics (as :func:`kernels.paged_attention_ref.reshape_and_cache_ref`)::

    key_cache[slot // block_size, slot % block_size] = key[t]      with slot = slot_mapping[t]

Each program copies the ``[num_kv_heads, head_dim]`` keys and values of ``BLOCK_T`` tokens
(heads and dims flattened into one padded axis). A negative slot (padding) is skipped.

Source: PagedAttention (Kwon et al., SOSP 2023); vLLM's ``reshape_and_cache``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 8  # tokens per program


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # Rows: BLOCK_T tokens; columns: (head, dim) flattened, padded to a power of two.
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    offs = tl.arange(0, BLOCK_HD).to(tl.int64)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    mask = (slot >= 0)[:, None] & (offs < NUM_KV_HEADS * HEAD_DIM)[None, :]
    dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs)[:, None] + (
        head * stride_ch + dim
    )[None, :]
    k = tl.load(key_ptr + tok[:, None] * stride_kt + (head * stride_kh + dim)[None, :], mask=mask)
    v = tl.load(value_ptr + tok[:, None] * stride_vt + (head * stride_vh + dim)[None, :], mask=mask)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the step's new keys and values into the paged caches, in place (Triton).

    Args:
        key: ``[T, num_kv_heads, head_dim]`` new keys (any strides, last dim contiguous).
        value: ``[T, num_kv_heads, head_dim]`` new values.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous.
        value_cache: same shape and strides as ``key_cache``.
        slot_mapping: ``[T]`` int64 flat slots (``block_id * block_size + offset``); a
            negative slot is skipped.

    Raises:
        ValueError: mismatched shapes or a non-contiguous head_dim.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if key_cache.shape[2:] != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} does not fit cache {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError("key and value caches must have the same shape and strides")
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    if key_cache.stride(3) != 1:
        raise ValueError("the caches' head_dim must be contiguous")
    block_t = BLOCK_T
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_HD=triton.next_power_of_2(num_kv_heads * head_dim),
        BLOCK_SIZE=key_cache.shape[1],
    )
