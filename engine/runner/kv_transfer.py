"""Copies between the paged KV pool and block payloads for the KV tiers (docs/kv_tiers.md).

A block's payload is the KV of every layer for its ``block_size`` positions, laid out as
``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`` in the pool's dtype and viewed
as a flat ``torch.uint8`` CPU tensor (``engine.kv_cache.tiers``). The pool keeps one
``(K, V)`` pair of ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer
(``engine.runner.model_runner``): a gather is one ``index_select`` per layer and K/V, a
scatter one ``index_copy_``. Gathers run on the connector's offload thread, scatters on the
engine thread between steps (``engine.core.kv_tiers``), both on blocks pinned outside every
request (``KVCacheManager.pin_cached`` / ``pin_new``), so no step reads or writes them
meanwhile; on CUDA they run on a stream of their own and synchronise it before returning
(not yet run on a GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def _stream(device: torch.device):
    """A side stream on CUDA (the copies overlap the step's kernels); a null context on CPU."""
    if device.type == "cuda":
        return torch.cuda.stream(torch.cuda.Stream(device))
    return contextlib.nullcontext()


def gather_blocks(kv_caches: KVCaches, block_ids: Sequence[int]) -> list[torch.Tensor]:
    """Copy blocks out of the pool as tier payloads.

    Args:
        kv_caches: The pool, one ``(K, V)`` pair per layer, each
            ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_ids: Physical block ids (pinned by the caller).

    Returns:
        One payload per block: a contiguous 1-D ``torch.uint8`` CPU tensor of
        ``num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize`` bytes, each its
        own storage (a tier may keep one and drop the rest).
    """
    if not block_ids:
        return []
    k0 = kv_caches[0][0]
    device = k0.device
    with _stream(device):
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        # [n, L, 2, block_size, heads, head_dim]: block-major, so each block is contiguous.
        out = torch.empty(
            (len(block_ids), len(kv_caches), 2, *k0.shape[1:]), dtype=k0.dtype, device=device
        )
        for layer, (k, v) in enumerate(kv_caches):
            out[:, layer, 0] = k.index_select(0, idx)
            out[:, layer, 1] = v.index_select(0, idx)
        host = out.cpu() if device.type != "cpu" else out
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    flat = host.view(torch.uint8).reshape(len(block_ids), -1)
    return [row.clone() for row in flat] if len(block_ids) > 1 else [flat[0]]


def scatter_blocks(
    kv_caches: KVCaches,
    block_ids: Sequence[int],
    payloads: Sequence[torch.Tensor],
    staging: torch.Tensor | None = None,
) -> None:
    """Copy tier payloads into pool blocks.

    Args:
        kv_caches: The pool (see :func:`gather_blocks`).
        block_ids: Physical block ids to write (pinned fresh blocks), one per payload.
        payloads: 1-D ``torch.uint8`` tensors as :func:`gather_blocks` makes them.
        staging: A reusable 2-D ``torch.uint8`` CPU buffer of at least ``len(payloads)`` rows
            of one block's bytes to stack them in (no allocation per call); None: a new one.

    Raises:
        ValueError: a payload whose size is not one block's bytes, or counts that differ.
    """
    if len(block_ids) != len(payloads):
        raise ValueError(f"{len(block_ids)} blocks for {len(payloads)} payloads")
    if not block_ids:
        return
    k0 = kv_caches[0][0]
    shape = (len(kv_caches), 2, *k0.shape[1:])
    nbytes = k0[0].numel() * k0.element_size() * 2 * len(kv_caches)
    for p in payloads:
        if p.dtype != torch.uint8 or p.numel() != nbytes:
            raise ValueError(f"a block payload must be {nbytes} uint8 bytes, got {p.numel()}")
    device = k0.device
    # [n, L, 2, block_size, heads, head_dim] in the pool's dtype.
    n = len(payloads)
    if staging is not None and staging.shape[0] >= n and staging.shape[1] == nbytes:
        flat = torch.stack(list(payloads), out=staging[:n])
    else:
        flat = torch.stack(list(payloads))
    host = flat.view(k0.dtype).view(n, *shape)
    with _stream(device):
        buf = host.to(device, non_blocking=device.type == "cuda")
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        for layer, (k, v) in enumerate(kv_caches):
            k.index_copy_(0, idx, buf[:, layer, 0])
            v.index_copy_(0, idx, buf[:, layer, 1])
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
