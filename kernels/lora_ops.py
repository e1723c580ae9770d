"""Triton LoRA shrink and expand over stacked slot buffers (Punica SGMV, segmented by slot).

Semantics, exactly those of :mod:`kernels.lora_ref` (token ``i``, slot ``s``, slice ``k``)::

    shrink:  h[k, i, :]                    = x[i] @ A_k[s, :r].T            [S, T, max_rank] f32
    expand:  y[i, off_k : off_k + out_k]  += scale_k[s] * h[k, i, :r] @ B_k[s, :, :r].T

**Fused slices.** Both ops take one stack (a single projection) or a sequence of stacks that
share an input: q/k/v (three ``A`` of the same shape) or gate/up. The shrink reads ``x`` once per
token block for every slice; the expand writes slice ``k`` into columns
``[off_k, off_k + out_k)`` of one ``y`` (the fused projection's output), so a fused q/k/v costs
one shrink and one expand launch. Several stacks reach the kernel through a small table of
device pointers (vLLM's approach; :func:`shrink_table`, :func:`expand_table`); a single stack is
passed as is. A caller that launches the same slices every step (a fused LoRA layer, a CUDA
graph's capture, which may not copy from the host) builds the tables once and passes them in.

**Schedule.** :func:`make_lora_batch` sorts the step's adapter tokens by slot once (on the host,
where the slots are known) and cuts each slot's segment into blocks of ``block_m`` tokens; each
program owns one block, so no program is spent on base-model tokens (slot -1 never appears) and
a program never mixes adapters. The rank of each slot may be passed per slice (``ranks``): loads
stop at the slot's own rank, so a rank-8 adapter in a rank-64 buffer reads 1/8 of the bytes.

Sources: Chen et al., "Punica: Multi-Tenant LoRA Serving" (MLSys 2024), SGMV/BGMV; Sheng et
al., "S-LoRA" (MLSys 2024); vLLM's ``lora/ops/triton_ops``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

from loraplex.kernels.lora_ref import TensorOrList, as_slices, slice_offsets
from loraplex.kernels.triton_lora import lora_expand_kernel, lora_shrink_kernel

SHRINK_BLOCK_K = 128  # input features per step of the shrink's reduction
SHRINK_PROGRAMS_PER_SM = 2  # the auto split-K's target: about this many shrink programs per SM
EXPAND_BLOCK_N = 128  # output columns per expand program


@dataclass(frozen=True)
class LoRABatch:
    """The step's tokens grouped by adapter slot, as the kernels consume them.

    Attributes:
        token_slots: ``[T]`` int64 slot of every token (-1: none), for the references.
        sorted_tokens: ``[N]`` int32 indices of the adapter tokens, sorted by slot (stable).
        blocks: ``[P, 3]`` int32 ``(slot, start, end)``: a program's rows are
            ``sorted_tokens[start : min(start + block_m, end)]``, all of ``slot``; a block
            with ``end <= start`` is empty and its programs return at once (a CUDA graph's
            fixed grid has more blocks than a step needs: ``engine.runner.cuda_graphs``).
        block_m: Tokens per block (the kernels' ``BLOCK_M``).
        slots: The distinct adapter slots of the step, ascending.
    """

    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    blocks: torch.Tensor
    block_m: int
    slots: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        """Programs per (rank or output tile, slice): ``P``."""
        return int(self.blocks.shape[0])


def lora_blocks(
    token_slots: Sequence[int], block_m: int | None = None
) -> tuple[list[int], list[tuple[int, int, int]], tuple[int, ...], int]:
    """The host side of :func:`make_lora_batch`: tokens sorted by slot, cut into blocks.

    Args:
        token_slots: Slot of each of the step's tokens (-1: base model).
        block_m: Tokens per block; None: 16 when every slot has at most 16 tokens, else 64.

    Returns:
        ``(sorted token indices, (slot, start, end) per block, distinct slots ascending,
        block_m)``.
    """
    by_slot: dict[int, list[int]] = {}
    for i, s in enumerate(token_slots):
        if s >= 0:
            by_slot.setdefault(int(s), []).append(i)
    if block_m is None:
        block_m = 16 if max((len(v) for v in by_slot.values()), default=0) <= 16 else 64
    order: list[int] = []
    blocks: list[tuple[int, int, int]] = []
    for slot in sorted(by_slot):
        start, end = len(order), len(order) + len(by_slot[slot])
        blocks.extend((slot, b, end) for b in range(start, end, block_m))
        order.extend(by_slot[slot])
    return order, blocks, tuple(sorted(by_slot)), block_m


def make_lora_batch(
    token_slots: Sequence[int], device: torch.device | str, block_m: int | None = None
) -> LoRABatch:
    """Group a step's tokens by slot and cut the segments into token blocks.

    Args:
        token_slots: Slot of each of the step's tokens (-1: base model).
        device: Where the index tensors go.
        block_m: Tokens per block (a power of two >= 16); None: 16 when every segment fits in
            16 tokens (decode-heavy steps), else 64.

    Returns:
        The :class:`LoRABatch`.
    """
    order, blocks, slots, block_m = lora_blocks(token_slots, block_m)
    return LoRABatch(
        token_slots=torch.tensor(list(token_slots), dtype=torch.long, device=device),
        sorted_tokens=torch.tensor(order, dtype=torch.int32, device=device),
        blocks=torch.tensor(blocks, dtype=torch.int32, device=device).reshape(-1, 3),
        block_m=block_m,
        slots=slots,
    )


def _interpreted() -> bool:
    return type(lora_shrink_kernel).__name__ == "InterpretedFunction"


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _interpreted():
        raise RuntimeError("Triton on CPU needs TRITON_INTERPRET=1 set before importing kernels")


def _per_slice(values: list[torch.Tensor] | None, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Per-slice ``[max_loras]`` vectors as one tensor and its slice stride (0 when shared)."""
    if values is None:
        return like, 0
    if len(values) == 1:
        return values[0], 0
    stacked = torch.stack([v.to(values[0].dtype) for v in values])
    return stacked, stacked.stride(0)


def _dot_f32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or _interpreted()


@lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def shrink_split_k(programs: int, in_features: int, block_k: int, x: torch.Tensor) -> int:
    """Split-K of a shrink launch: enough to give about ``SHRINK_PROGRAMS_PER_SM`` programs per SM.

    A shrink's output is tiny (``[S, T, rank]``) and its reduction long (``in`` features), so a
    step of few token blocks (one adapter, or decode) leaves most SMs idle unless the reduction
    is split (vLLM's shrink splits K likewise). Each split keeps at least one ``block_k`` step.

    Args:
        programs: Programs of the unsplit launch (token blocks x rank tiles x slices).
        in_features: Length of the reduction.
        block_k: Features per reduction step of the kernel.
        x: The input (its device and dtype decide: 1 off the GPU and for float32).

    Returns:
        A power of two >= 1.
    """
    if x.device.type != "cuda" or x.dtype == torch.float32 or programs <= 0:
        return 1
    target = SHRINK_PROGRAMS_PER_SM * _num_sms(x.device.index or 0)
    want = min(-(-target // programs), max(1, in_features // block_k))
    return 1 << (want.bit_length() - 1)


def shrink_table(stacks: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The shrink's pointer table for several ``A`` stacks: ``[S]`` int64 data pointers.

    The stacks must stay allocated (and in place) while the table is used.
    """
    return torch.tensor([a.data_ptr() for a in stacks], dtype=torch.int64, device=device)


def expand_table(
    stacks: Sequence[torch.Tensor], offsets: Sequence[int] | None, device: torch.device
) -> torch.Tensor:
    """The expand's table for several ``B`` stacks: ``[S, 4]`` int64.

    One row per stack: ``(data pointer, column offset, width, slot stride)``. The stacks must
    stay allocated (and in place) while the table is used.
    """
    cols = slice_offsets([b.shape[1] for b in stacks], offsets)
    rows = [[b.data_ptr(), c, b.shape[1], b.stride(0)] for b, c in zip(stacks, cols, strict=True)]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def lora_shrink(
    x: torch.Tensor,
    lora_a: TensorOrList,
    batch: LoRABatch,
    ranks: TensorOrList | None = None,
    *,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shrink every adapter token of the step: ``h[k, i] = x[i] @ A_k[slot(i), :r].T`` (Triton).

    Args:
        x: ``[T, in]`` float32/float16/bfloat16, last dim contiguous.
        lora_a: ``[max_loras, max_rank, in]`` per slice (one tensor, or several of the same
            shape and strides: fused q/k/v or gate/up).
        batch: The step's :class:`LoRABatch`.
        ranks: ``[max_loras]`` int32 rank of each slot, per slice (None: ``max_rank``).
        split_k: Split the ``in`` reduction over this many programs (atomic float32 adds into a
            zeroed ``h``): more parallelism for few tokens and a wide input. None: chosen by
            :func:`shrink_split_k` (1 for float32 inputs and off the GPU: float32 stays
            deterministic and bit-exact run to run).
        out: Optional ``[S, T, max_rank]`` float32 destination.
        table: :func:`shrink_table` of ``lora_a`` on ``x``'s device (several stacks only);
            None builds it (a host-to-device copy: not inside a CUDA graph capture).

    Returns:
        ``[S, T, max_rank]`` float32; rows of base-model tokens (slot -1) are not written.

    Raises:
        ValueError: slices of different shapes or strides, or ``in`` not matching ``x``.
    """
    stacks = as_slices(lora_a)
    first = stacks[0]
    num_loras, max_rank, in_features = first.shape
    if any(a.shape != first.shape or a.stride() != first.stride() for a in stacks):
        raise ValueError("fused A stacks must share shape and strides")
    if x.shape[1] != in_features or first.stride(2) != 1:
        raise ValueError(f"x {tuple(x.shape)} does not fit A {tuple(first.shape)}")
    _check_device(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    block_r = min(64, max(16, triton.next_power_of_2(max_rank)))
    block_k = min(SHRINK_BLOCK_K, max(16, triton.next_power_of_2(in_features)))
    if split_k is None:
        programs = batch.num_blocks * triton.cdiv(max_rank, block_r) * len(stacks)
        split_k = shrink_split_k(programs, in_features, block_k, x)
    shape = (len(stacks), x.shape[0], max_rank)
    if out is None:
        out = (torch.zeros if split_k > 1 else torch.empty)(
            shape, dtype=torch.float32, device=x.device
        )
    elif split_k > 1:
        out.zero_()
    if batch.num_blocks == 0:
        return out
    rank_vec, stride_rs = _per_slice(as_slices(ranks), batch.blocks)
    if len(stacks) == 1:
        table = first
    elif table is None:
        table = shrink_table(stacks, x.device)
    grid = (batch.num_blocks, triton.cdiv(max_rank, block_r), len(stacks) * split_k)
    lora_shrink_kernel[grid](
        x,
        first,
        table,
        out,
        batch.sorted_tokens,
        batch.blocks,
        rank_vec,
        in_features,
        max_rank,
        x.stride(0),
        first.stride(0),
        first.stride(1),
        out.stride(0),
        out.stride(1),
        stride_rs,
        BLOCK_M=batch.block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        MULTI=len(stacks) > 1,
        HAS_RANKS=ranks is not None,
        DOT_F32=_dot_f32(x.dtype),
    )
    return out


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: TensorOrList,
    scales: TensorOrList,
    batch: LoRABatch,
    ranks: TensorOrList | None = None,
    offsets: Sequence[int] | None = None,
    *,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expand and accumulate: ``y[i, off_k:off_k+out_k] += scale_k[s] * h[k, i] @ B_k[s].T``.

    Each ``(token, column)`` belongs to one program (slices own disjoint columns), so the
    read-modify-write of ``y`` needs no atomics; the sum is formed in float32 and rounded once.

    Args:
        y: ``[T, total_out]``, last dim contiguous; modified in place.
        h: ``[S, T, max_rank]`` float32 from :func:`lora_shrink`.
        lora_b: ``[max_loras, out_k, max_rank]`` per slice (widths may differ, e.g. q vs k/v;
            same dtype, rank-contiguous, same column stride).
        scales: ``[max_loras]`` float per slice (0 for a slot that does not target the slice).
        batch: The step's :class:`LoRABatch`.
        ranks: ``[max_loras]`` int32 rank of each slot, per slice (None: ``max_rank``).
        offsets: Column offset of each slice in ``y``; None packs the slices in order.
        table: :func:`expand_table` of ``lora_b`` and ``offsets`` on ``y``'s device (several
            stacks only); None builds it (a host-to-device copy: not inside a CUDA graph
            capture).

    Returns:
        ``y``.

    Raises:
        ValueError: mismatched slices or a slice past ``y``'s columns.
    """
    stacks = as_slices(lora_b)
    first = stacks[0]
    max_rank = first.shape[2]
    widths = [b.shape[1] for b in stacks]
    cols = slice_offsets(widths, offsets)
    if any(
        b.shape[2] != max_rank or b.stride(2) != 1 or b.stride(1) != first.stride(1) for b in stacks
    ):
        raise ValueError("B stacks must share max_rank, dtype and column stride")
    if any(c < 0 or c + w > y.shape[1] for c, w in zip(cols, widths, strict=True)):
        raise ValueError(
            f"slices {list(zip(cols, widths, strict=True))} overflow y {tuple(y.shape)}"
        )
    if y.stride(1) != 1:
        raise ValueError("y's last dim must be contiguous")
    _check_device(y)
    if batch.num_blocks == 0:
        return y
    scale_vec, stride_ss = _per_slice(as_slices(scales), batch.blocks)
    rank_vec, stride_rs = _per_slice(as_slices(ranks), batch.blocks)
    if len(stacks) == 1:
        table = first
    elif table is None:
        table = expand_table(stacks, cols, y.device)
    block_n = min(EXPAND_BLOCK_N, max(16, triton.next_power_of_2(max(widths))))
    grid = (batch.num_blocks, triton.cdiv(max(widths), block_n), len(stacks))
    lora_expand_kernel[grid](
        y,
        h,
        first,
        table,
        scale_vec,
        batch.sorted_tokens,
        batch.blocks,
        rank_vec,
        cols[0],
        widths[0],
        first.stride(0),
        max_rank,
        y.stride(0),
        h.stride(0),
        h.stride(1),
        first.stride(1),
        stride_ss,
        stride_rs,
        BLOCK_M=batch.block_m,
        BLOCK_N=block_n,
        BLOCK_K=max(16, min(64, triton.next_power_of_2(max_rank))),
        MULTI=len(stacks) > 1,
        HAS_RANKS=ranks is not None,
        DOT_F32=_dot_f32(first.dtype),
    )
    return y
