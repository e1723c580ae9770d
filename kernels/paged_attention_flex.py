"""Decode attention that reads the paged KV cache in place, through compiled FlexAttention (CPU).

The torch reference's decode (``kernels.paged_attention_ref``) copies each sequence's whole
context out of the paged cache into a padded batch in every layer of every step. Here the
cache is viewed, without a copy, as one long key sequence ``[1, Hkv, num_blocks * block_size,
D]`` shared by every sequence (broadcast over the batch), and each sequence's block table *is*
its row of a block-sparse mask: a ``BlockMask`` whose KV block is one page lists, for sequence
``b``, its physical blocks in order. The kernel (inductor's CPU FlexAttention template: an
online softmax over only the listed blocks) never touches another sequence's blocks. Every
block but the last is "full" (no mask); the last is "partial", and a ``mask_mod`` keeps its
first ``seq_len - (n - 1) * block_size`` positions. A KV head's ``G`` query heads are its
query rows (``[B, Hkv, G, D]``), so each K/V block is read once per KV head into a ``G x
block_size`` tile. The mask is built once per step and shared by all layers.

Algorithm: PagedAttention's block tables (Kwon et al., SOSP 2023) expressed as FlexAttention's
block-sparse mask (Dong et al., "Flex Attention: A Programming Model for Generating Optimized
Attention Kernels", 2024, which describes paged attention as a block-mask conversion).
Measured against the gathered path with ``python -m bench.cpu_decode_attention``
(docs/benchmarks.md).

Compilation: ``torch.compile(..., dynamic=False)`` (inductor's C++ codegen; a C++ compiler
must be installed). Shapes are static: the batch is padded to a bucket (:data:`BATCH_BUCKETS`),
so there is one compilation per bucket, head configuration and cache size, about 3 s each on
first use; inductor caches the compiled code on disk, so a restart reuses it (0.1-0.2 s).
``dynamic=True`` is not used: inductor's CPU flex template failed to compile (C++ errors) once
the query-row dimension became symbolic.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Decode batches are padded up to one of these (then to multiples of 256)."""

_COMPILED: Any = None
_LOCK = threading.Lock()


def _flex_decode_kernel(query, keys, values, block_mask, scale):
    """``flex_attention`` in a function of its own (its own dynamo cache entries)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(query, keys, values, block_mask=block_mask, scale=scale)


def _compiled() -> Any:
    global _COMPILED
    with _LOCK:
        if _COMPILED is None:
            _COMPILED = torch.compile(_flex_decode_kernel, dynamic=False)
    return _COMPILED


def batch_bucket(batch: int) -> int:
    """The padded batch of a decode step of ``batch`` sequences."""
    for size in BATCH_BUCKETS:
        if batch <= size:
            return size
    return -(-batch // BATCH_BUCKETS[-1]) * BATCH_BUCKETS[-1]


class PagedDecodeMask:
    """One decode step's block tables as a FlexAttention ``BlockMask`` (built once per step).

    Args:
        block_tables: ``[B, max_blocks]`` int32/int64 physical block ids of each sequence.
        seq_lens: ``[B]`` context length of each sequence (>= 1), this step's token included.
        num_blocks: Blocks in the cache (``key_cache.shape[0]``).
        block_size: Tokens per block.
        group: Query heads per KV head (``num_heads // num_kv_heads``).

    Rows past ``B`` (up to :func:`batch_bucket`) are padding: they read block 0 and their
    output is dropped. The mask's index rows are as wide as the cache (FlexAttention requires
    the mask to cover the whole key length); only each row's first entries are read, so the
    rest is left uninitialised.
    """

    def __init__(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        num_blocks: int,
        block_size: int,
        group: int,
    ):
        from torch.nn.attention.flex_attention import BlockMask

        batch = seq_lens.shape[0]
        padded = batch_bucket(batch)
        lens = seq_lens.to(device="cpu", dtype=torch.int32)
        used = (lens + block_size - 1) // block_size  # [B] blocks per sequence
        width = int(used.max())
        tables = block_tables[:, :width].to(device="cpu", dtype=torch.int32)
        full_num = torch.zeros(padded, 1, 1, dtype=torch.int32)
        full_num[:batch, 0, 0] = used - 1
        full_idx = torch.empty(padded, 1, 1, num_blocks, dtype=torch.int32)
        full_idx[:batch, 0, 0, :width] = tables
        kv_idx = torch.empty(padded, 1, 1, num_blocks, dtype=torch.int32)
        kv_idx[:, 0, 0, 0] = 0  # padding rows: block 0, output dropped
        kv_idx[:batch, 0, 0, 0] = tables.gather(1, (used - 1).long().unsqueeze(1)).squeeze(1)
        tail = torch.full((padded,), block_size, dtype=torch.int32)
        tail[:batch] = lens - (used - 1) * block_size  # valid positions in the last block

        def keep_tail(b, h, q_idx, kv):
            return (kv % block_size) < tail[b]

        self.batch, self.padded = batch, padded
        self.num_blocks, self.block_size, self.group = num_blocks, block_size, group
        self.block_mask = BlockMask.from_kv_blocks(
            torch.ones(padded, 1, 1, dtype=torch.int32),
            kv_idx,
            full_num,
            full_idx,
            BLOCK_SIZE=(group, block_size),
            mask_mod=keep_tail,
            seq_lengths=(group, num_blocks * block_size),
            compute_q_blocks=False,
        )


def paged_decode_flex(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    mask: PagedDecodeMask,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its paged context, read in place (CPU, float32).

    Args:
        query: ``[B, num_heads, head_dim]`` float32, row ``b`` the decode query of sequence
            ``b`` of ``mask``.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32, already
            holding this step's keys.
        value_cache: same shape as ``key_cache``. The unused tail of each sequence's last
            block must be finite: masked positions get probability 0, and ``0 * NaN`` is NaN
            (the engine's pool starts zeroed and only holds written K/V; the gathered
            reference zeroes the tail instead). Other sequences' blocks are never read.
        mask: The step's :class:`PagedDecodeMask`.
        scale: Softmax scale.

    Returns:
        ``[B, num_heads, head_dim]`` float32.

    Raises:
        ValueError: the mask was built for another batch or cache geometry.
        Whatever inductor raises when it cannot compile (no C++ compiler, say), or dynamo's
        error past its recompile limit (eager FlexAttention would materialise scores over the
        whole cache): callers fall back to the gathered reference.
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    batch, num_heads, _ = query.shape
    group = num_heads // num_kv_heads
    if (batch, num_blocks, block_size, group) != (
        mask.batch, mask.num_blocks, mask.block_size, mask.group,
    ):  # fmt: skip
        raise ValueError(
            f"mask built for batch {mask.batch}, {mask.num_blocks} blocks of "
            f"{mask.block_size}, group {mask.group}; got batch {batch}, {num_blocks} blocks of "
            f"{block_size}, group {group}"
        )
    q = query.new_zeros(mask.padded, num_kv_heads, group, head_dim)
    q[:batch] = query.view(batch, num_kv_heads, group, head_dim)
    flat = num_blocks * block_size
    keys = key_cache.view(flat, num_kv_heads, head_dim).permute(1, 0, 2).unsqueeze(0)
    values = value_cache.view(flat, num_kv_heads, head_dim).permute(1, 0, 2).unsqueeze(0)
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        out = _compiled()(
            q,
            keys.expand(mask.padded, -1, -1, -1),
            values.expand(mask.padded, -1, -1, -1),
            mask.block_mask,
            scale,
        )  # [padded, Hkv, G, D]
    return out[:batch].reshape(batch, num_heads, head_dim)
