"""One entry point per op: the Triton kernel on CUDA, the plain-torch reference on CPU.

``backend`` overrides the choice: ``"triton"`` runs the kernel whatever the device (on CPU
this needs ``TRITON_INTERPRET=1`` set before the kernels are imported: the interpreter, for
tests), ``"torch"`` runs the reference, None picks by the device of the first tensor.

| op | Triton | reference |
| --- | --- | --- |
| :func:`reshape_and_cache` | :mod:`kernels.triton_cache` | :mod:`kernels.paged_attention_ref` |
| :func:`paged_attention` | :mod:`kernels.triton_attention` | :mod:`kernels.paged_attention_ref` |
| :func:`lora_shrink`, :func:`lora_expand` | :mod:`kernels.lora_ops` | :mod:`kernels.lora_ref` |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from loraplex.kernels import lora_ops, lora_ref, paged_attention_ref, triton_attention, triton_cache
from loraplex.kernels.lora_ops import LoRABatch, make_lora_batch

Backend = Literal["torch", "triton"] | None


def use_triton(device: torch.device, backend: Backend = None) -> bool:
    """Whether an op on ``device`` runs the Triton kernel.

    Raises:
        ValueError: an unknown backend name.
    """
    if backend is None:
        return device.type == "cuda"
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown kernel backend {backend!r}; expected 'torch' or 'triton'")
    return backend == "triton"


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: Backend = None,
) -> None:
    """Write new K/V via the slot mapping (see :func:`kernels.triton_cache.reshape_and_cache`)."""
    fn = (
        triton_cache.reshape_and_cache
        if use_triton(key.device, backend)
        else paged_attention_ref.reshape_and_cache_ref
    )
    fn(key, value, key_cache, value_cache, slot_mapping)


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
    backend: Backend = None,
) -> torch.Tensor:
    """Paged attention (see :func:`kernels.triton_attention.paged_attention`).

    Returns:
        ``[T, num_heads, head_dim]`` in ``query``'s dtype.
    """
    fn = (
        triton_attention.paged_attention
        if use_triton(query.device, backend)
        else paged_attention_ref.paged_attention_ref
    )
    return fn(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        sliding_window=sliding_window,
    )


def lora_shrink(
    x: torch.Tensor,
    lora_a: lora_ref.TensorOrList,
    batch: LoRABatch,
    ranks: lora_ref.TensorOrList | None = None,
    *,
    backend: Backend = None,
) -> torch.Tensor:
    """``h[k, i] = x[i] @ A_k[slot(i), :r].T`` (see :func:`kernels.lora_ops.lora_shrink`).

    Returns:
        ``[num_slices, T, max_rank]`` float32 (rows of slot -1 tokens: 0 from the reference,
        unwritten by the kernel).
    """
    if use_triton(x.device, backend):
        return lora_ops.lora_shrink(x, lora_a, batch, ranks)
    return lora_ref.lora_shrink_ref(x, lora_a, batch.token_slots, ranks)


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: lora_ref.TensorOrList,
    scales: lora_ref.TensorOrList,
    batch: LoRABatch,
    ranks: lora_ref.TensorOrList | None = None,
    offsets: Sequence[int] | None = None,
    *,
    backend: Backend = None,
) -> torch.Tensor:
    """``y[i, slice k] += scale_k[s] * h[k, i] @ B_k[s].T`` in place (see ``lora_ops``).

    Returns:
        ``y``.
    """
    if use_triton(y.device, backend):
        return lora_ops.lora_expand(y, h, lora_b, scales, batch, ranks, offsets)
    return lora_ref.lora_expand_ref(y, h, lora_b, scales, batch.token_slots, ranks, offsets)


__all__ = [
    "LoRABatch",
    "lora_expand",
    "lora_shrink",
    "make_lora_batch",
    "paged_attention",
    "reshape_and_cache",
    "use_triton",
]
