"""Plain-torch float32 references for the LoRA shrink and expand (the Triton kernels' oracles).

Punica semantics over stacked slot buffers: token ``i`` carries slot ``s = token_slots[i]``
(-1: no adapter) and, for each fused slice ``k`` (q/k/v, or gate/up, or a single projection)::

    shrink:  h[k, i, :]                            = x[i] @ A_k[s, :r].T        (r = rank)
    expand:  y[i, off_k : off_k + out_k]          += scale_k[s] * h[k, i, :r] @ B_k[s, :, :r].T

with ``A_k: [max_loras, max_rank, in]``, ``B_k: [max_loras, out_k, max_rank]``,
``scale_k: [max_loras]`` and ``r = ranks_k[s]`` (``max_rank`` when no ranks are given; ranks
beyond a slot's own are zero-padded in the buffers, so both give the same numbers). Rows of
``h`` past ``r`` are 0; rows of tokens with slot -1 are 0 in ``h`` and untouched in ``y``.

Source: Chen et al., "Punica: Multi-Tenant LoRA Serving" (MLSys 2024), SGMV/BGMV.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TensorOrList = torch.Tensor | Sequence[torch.Tensor]


def as_slices(value: TensorOrList | None) -> list[torch.Tensor] | None:
    """One tensor (a single slice) or a sequence of per-slice tensors, as a list."""
    if value is None:
        return None
    return [value] if isinstance(value, torch.Tensor) else list(value)


def slice_offsets(widths: Sequence[int], offsets: Sequence[int] | None) -> list[int]:
    """Output column offset of each slice: the given ones, else the slices packed in order."""
    if offsets is not None:
        if len(offsets) != len(widths):
            raise ValueError(f"{len(offsets)} offsets for {len(widths)} slices")
        return list(offsets)
    out, at = [], 0
    for w in widths:
        out.append(at)
        at += w
    return out


def _segments(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    slots = token_slots.to(torch.long)
    return [(int(s), (slots == s).nonzero().squeeze(1)) for s in slots.unique() if s >= 0]


def lora_shrink_ref(
    x: torch.Tensor,
    lora_a: TensorOrList,
    token_slots: torch.Tensor,
    ranks: TensorOrList | None = None,
) -> torch.Tensor:
    """``h[k, i] = x[i] @ A_k[slot(i), :r].T`` in float32 (see the module docstring).

    Args:
        x: ``[T, in]``.
        lora_a: ``[max_loras, max_rank, in]`` per slice (one tensor or a sequence).
        token_slots: ``[T]`` int slot of each token, -1 for none.
        ranks: ``[max_loras]`` int rank per slot, per slice; None: ``max_rank``.

    Returns:
        ``[num_slices, T, max_rank]`` float32.
    """
    stacks = as_slices(lora_a)
    rank_list = as_slices(ranks)
    max_rank = stacks[0].shape[1]
    h = torch.zeros(len(stacks), x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    for slot, idx in _segments(token_slots):
        xs = x[idx].float()
        for k, a in enumerate(stacks):
            r = int(rank_list[k][slot]) if rank_list is not None else max_rank
            h[k, idx, :r] = xs @ a[slot, :r].float().T
    return h


def lora_expand_ref(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: TensorOrList,
    scales: TensorOrList,
    token_slots: torch.Tensor,
    ranks: TensorOrList | None = None,
    offsets: Sequence[int] | None = None,
) -> torch.Tensor:
    """``y[i, off_k:off_k+out_k] += scale_k[s] * h[k, i, :r] @ B_k[s, :, :r].T``, in place.

    The sum is formed in float32 and rounded once to ``y``'s dtype.

    Args:
        y: ``[T, total_out]``.
        h: ``[num_slices, T, max_rank]`` (float32 from the shrink).
        lora_b: ``[max_loras, out_k, max_rank]`` per slice.
        scales: ``[max_loras]`` float per slice.
        token_slots: ``[T]`` int slot of each token, -1 for none.
        ranks: ``[max_loras]`` int rank per slot, per slice; None: ``max_rank``.
        offsets: Column offset of each slice in ``y``; None packs the slices in order.

    Returns:
        ``y``.
    """
    stacks = as_slices(lora_b)
    scale_list = as_slices(scales)
    rank_list = as_slices(ranks)
    cols = slice_offsets([b.shape[1] for b in stacks], offsets)
    max_rank = stacks[0].shape[2]
    for slot, idx in _segments(token_slots):
        for k, b in enumerate(stacks):
            r = int(rank_list[k][slot]) if rank_list is not None else max_rank
            width = b.shape[1]
            delta = h[k, idx, :r].float() @ b[slot, :, :r].float().T
            view = y[idx, cols[k] : cols[k] + width].float()
            y[idx, cols[k] : cols[k] + width] = (view + scale_list[k][slot].float() * delta).to(
                y.dtype
            )
    return y
