"""Fused projections: several linears that read the same input, computed as one GEMM.

A decoder layer's q/k/v projections all read the normed hidden states, as do the MLP's gate
and up projections. :class:`FusedLinear` holds their weights stacked by rows (``[q; k; v]``:
``[q_out + k_out + v_out, in]``), so one matrix multiply produces all of them and
:meth:`FusedLinear.split` cuts the output into per-projection column views (no copy). One GEMM
with a wider output reads the input once and keeps the math library's kernels busier than three
narrow ones (vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear`` do the same).

Checkpoints (and PEFT adapters) keep the projections separate: ``self_attn.q_proj.weight``
and so on. Each fused module names its slices, so :func:`stacked_params` maps every fused
parameter to the checkpoint tensors whose rows it stacks (vLLM's ``stacked_params_mapping``
idea, derived here from the modules rather than written as a table), and :class:`LinearSlice`
is one projection's view of the fused module: its name, shape and row range, what LoRA targets
and adapter validation see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.models.packed_linear import PackedLinear


@dataclass(frozen=True)
class LinearSlice:
    """One projection inside a :class:`FusedLinear`: rows ``[offset, offset + out_features)``.

    Attributes:
        fused: The fused module.
        name: The projection's own (checkpoint, PEFT) name, e.g. ``k_proj``.
        offset: First output row (and output column) of the projection in the fused module.
        out_features: The projection's output size.
    """

    fused: SlicedOutput
    name: str
    offset: int
    out_features: int

    @property
    def in_features(self) -> int:
        """The shared input size."""
        return self.fused.in_features

    @property
    def weight(self) -> torch.Tensor:
        """``[out_features, in_features]``: a view of the fused weight's rows."""
        return self.fused.weight[self.offset : self.offset + self.out_features]

    @property
    def bias(self) -> torch.Tensor | None:
        """``[out_features]`` view of the fused bias, or None when the module has none."""
        bias = self.fused.bias
        return None if bias is None else bias[self.offset : self.offset + self.out_features]


class SlicedOutput:
    """What a fused projection's users need of it, whatever computes it.

    The slices' names, widths and offsets (set by the subclass), :meth:`slices` and
    :meth:`split`. Shared by :class:`FusedLinear` and its oneDNN-prepacked form
    (:class:`PackedFusedLinear`).
    """

    slice_names: tuple[str, ...]
    slice_sizes: tuple[int, ...]
    slice_offsets: tuple[int, ...]

    def slices(self) -> list[LinearSlice]:
        """Every projection as a :class:`LinearSlice`, in row order."""
        return [
            LinearSlice(self, name, offset, size)
            for name, offset, size in zip(
                self.slice_names, self.slice_offsets, self.slice_sizes, strict=True
            )
        ]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Cut an output ``[..., out_features]`` into the projections' ``[..., out_k]`` views."""
        return y.split(self.slice_sizes, dim=-1)


class FusedLinear(SlicedOutput, nn.Linear):
    """An ``nn.Linear`` whose output rows are several named projections of the same input.

    ``y = x @ W.T + b`` with ``W = cat([W_1, ..., W_n])`` (rows) and ``b`` likewise, so
    ``y[..., off_k : off_k + out_k] = x @ W_k.T + b_k``: the separate projections' outputs,
    side by side in slice order.

    Args:
        in_features: The shared input size.
        slices: ``(name, out_features)`` of each projection, in row order (``q_proj``,
            ``k_proj``, ``v_proj``).
        bias: Whether every projection has a bias (all or none).

    Raises:
        ValueError: no slices, a repeated name or a non-positive width.
    """

    def __init__(
        self, in_features: int, slices: Sequence[tuple[str, int]], bias: bool = True
    ) -> None:
        names = [name for name, _ in slices]
        sizes = [int(size) for _, size in slices]
        if not slices or len(set(names)) != len(names) or min(sizes) <= 0:
            raise ValueError(f"bad fused slices {list(slices)}")
        super().__init__(in_features, sum(sizes), bias=bias)
        self.slice_names = tuple(names)
        self.slice_sizes = tuple(sizes)
        offsets, at = [], 0
        for size in sizes:
            offsets.append(at)
            at += size
        self.slice_offsets = tuple(offsets)

    def to_packed(self, batch_hint: int) -> PackedFusedLinear:
        """This projection with its weight prepacked for oneDNN (``pack_linears`` calls it)."""
        return PackedFusedLinear(self, batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in] -> [..., sum(out_k)]``: one GEMM for every projection."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        """The slices after ``nn.Linear``'s sizes (for ``print(model)``)."""
        pairs = zip(self.slice_names, self.slice_sizes, strict=True)
        parts = ", ".join(f"{n}={s}" for n, s in pairs)
        return f"{super().extra_repr()}, slices=({parts})"


class PackedFusedLinear(SlicedOutput, PackedLinear):
    """A :class:`FusedLinear` on a oneDNN-prepacked weight (``engine.models.packed_linear``).

    One packed GEMM for q/k/v (or gate/up), the same slices.

    Args:
        fused: The fused projection to pack (not modified).
        batch_hint: See ``engine.models.packed_linear.PACK_BATCH_HINT``.

    Raises:
        ValueError: a weight oneDNN cannot pack (``can_pack``).
    """

    def __init__(self, fused: FusedLinear, batch_hint: int) -> None:
        super().__init__(fused, batch_hint)
        self.slice_names = fused.slice_names
        self.slice_sizes = fused.slice_sizes
        self.slice_offsets = fused.slice_offsets


def fused_slices(module: nn.Module) -> list[LinearSlice]:
    """The slices of a fused projection, or of one a LoRA layer wraps (its ``base``).

    The projection is a :class:`FusedLinear`, packed or not.

    Raises:
        TypeError: ``module`` is neither.
    """
    base = getattr(module, "base", module)
    if not isinstance(base, SlicedOutput):
        raise TypeError(f"{type(module).__name__} is not a fused projection")
    return base.slices()


def stacked_params(model: nn.Module) -> dict[str, list[tuple[str, int, int]]]:
    """Where each fused parameter's rows come from in a checkpoint with separate projections.

    For a fused module at ``P.qkv_proj`` with slices ``q_proj``, ``k_proj``, ``v_proj``::

        "P.qkv_proj.weight" -> [("P.q_proj.weight", 0, q), ("P.k_proj.weight", q, q + k),
                                ("P.v_proj.weight", q + k, q + 2k)]

    and likewise for ``bias`` when it has one.

    Args:
        model: Any module; its :class:`FusedLinear` submodules are found by walking it.

    Returns:
        Fused parameter name (as in ``model.state_dict()``) to ``(separate name, start row,
        end row)`` of each slice, in row order.
    """
    plan: dict[str, list[tuple[str, int, int]]] = {}
    for path, module in model.named_modules():
        if not isinstance(module, FusedLinear):
            continue
        parent = path.rsplit(".", 1)[0] + "." if "." in path else ""
        params = ["weight"] + (["bias"] if module.bias is not None else [])
        for param in params:
            plan[f"{path}.{param}"] = [
                (f"{parent}{s.name}.{param}", s.offset, s.offset + s.out_features)
                for s in module.slices()
            ]
    return plan
