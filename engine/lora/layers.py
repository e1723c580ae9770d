"""Per-request LoRA deltas in one batch (Punica / S-LoRA semantics): the model's LoRA layers.

Every token of a step carries the device slot of its request's adapter (-1: the base model).
Each targeted projection adds, for token ``i`` with slot ``s = token_slots[i]``::

    y[i] += scale[s] * (x[i] @ A[s].T) @ B[s].T          (shrink, then expand)

with the stacked slot buffers ``A: [max_loras, max_rank, in]`` and ``B: [max_loras, out,
max_rank]`` of ``engine.lora.slots`` (ranks below ``max_rank`` are zero-padded; the slot's own
rank is sliced off so padding costs nothing). :func:`install_lora` swaps each targeted
``nn.Linear`` for a :class:`LoRALinear` (vLLM's LoRA layers do the same); the arithmetic is the
engine's one :class:`engine.lora.backend.LoRABackend`, whose per-step metadata the model runner
updates before each forward pass.

A fused projection (q/k/v or gate/up as one GEMM, ``engine.models.fused``) is wrapped once, in a
:class:`FusedLoRALinear` holding one set of slot buffers per slice: slice ``k`` adds its own
adapter's delta to its own columns ``[off_k, off_k + out_k)`` of the fused output, so every
slice's delta is exactly the separate projection's (an adapter that targets ``q_proj`` and
``v_proj`` only has rank 0 on ``k_proj`` and adds nothing to k's columns).

Source: Chen et al., "Punica: Multi-Tenant LoRA Serving" (MLSys 2024), SGMV semantics
``y[s[i]:s[i+1]] += x @ A.T @ B.T``; Sheng et al., "S-LoRA" (MLSys 2024).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from loraplex.engine.models.fused import FusedLinear, LinearSlice

if TYPE_CHECKING:
    from loraplex.engine.lora.backend import LoRABackend
    from loraplex.engine.lora.slots import SlotBuffers


class _WrapsBase:
    """The base projection's weight and sizes, as a LoRA wrapper shows them (``self.base``).

    Callers that read a projection's weight or sizes see the base's, fused or not.
    """

    base: nn.Module

    @property
    def weight(self) -> torch.Tensor:
        """The base weight (``[out, in]``; fused: ``[sum out_k, in]``)."""
        return self.base.weight

    @property
    def in_features(self) -> int:
        """The base projection's input size."""
        return self.base.in_features

    @property
    def out_features(self) -> int:
        """The base projection's output size (fused: the slices' sum)."""
        return self.base.out_features


class LoRALinear(_WrapsBase, nn.Module):
    """A base ``nn.Linear`` plus the per-token LoRA delta of the step's adapters.

    Args:
        base: The projection (its weights stay as loaded).
        buffers: This projection's stacked slot weights.
        backend: The engine's LoRA backend, shared by every LoRA layer of the model.
        layer_idx: The decoder layer (with ``name``, the key of ``buffers`` in the engine's
            slot buffers; a compiled forward's LoRA op finds them by it).
        name: The projection's name (``q_proj`` ...).
    """

    def __init__(
        self,
        base: nn.Linear,
        buffers: SlotBuffers,
        backend: LoRABackend,
        layer_idx: int = -1,
        name: str = "",
    ):
        super().__init__()
        self.base = base
        self.buffers = buffers
        self.backend = backend
        self.layer_idx = layer_idx
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., T, in] -> [..., T, out]``: base projection plus LoRA deltas.

        The leading dimensions (a transformers model's batch of one) are flattened: row ``t``
        of the step is token ``t`` of the step's metadata.
        """
        y = self.base(x)
        if torch.compiler.is_compiling():  # the step's deltas: one opaque op, a no-op without
            torch.ops.loraplex.lora_delta_(  # adapter tokens (engine.runner.compiled_step)
                y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), self.layer_idx, self.name
            )
            return y
        if self.backend.active:
            if x.dim() == 2:
                self.backend.apply(y, x, self.buffers)
            else:
                flat = y.view(-1, y.shape[-1])
                self.backend.apply(flat, x.reshape(-1, x.shape[-1]), self.buffers)
        return y


class FusedLoRALinear(_WrapsBase, nn.Module):
    """A fused projection plus each slice's per-token LoRA delta (exact per slice).

    ``y = base(x)``, then for each slice ``k`` (``q_proj``, ``k_proj``, ``v_proj``, or
    ``gate_proj``, ``up_proj``) and token ``i`` of slot ``s``::

        y[i, off_k : off_k + out_k] += scale_k[s] * (x[i] @ A_k[s].T) @ B_k[s].T

    with the slice's own buffers (its own rank per slot: 0 where the adapter does not target
    it). The backend computes every slice of one fused layer together
    (:meth:`engine.lora.backend.LoRABackend.apply_slices`: one shrink and one expand launch
    with Triton).

    Args:
        base: The fused projection (its weights stay as loaded).
        buffers: One :class:`SlotBuffers` per slice, in the base's slice order.
        backend: The engine's LoRA backend.
        layer_idx: The decoder layer (with the slices' names, the keys of ``buffers`` in the
            engine's slot buffers; a compiled forward's LoRA op finds them by it).

    Raises:
        ValueError: not one buffer per slice, or a buffer whose shape is not its slice's.
    """

    def __init__(
        self,
        base: FusedLinear,
        buffers: list[SlotBuffers],
        backend: LoRABackend,
        layer_idx: int = -1,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        if len(buffers) != len(base.slice_sizes):
            raise ValueError(f"{len(buffers)} slot buffers for {len(base.slice_sizes)} slices")
        for buf, size in zip(buffers, base.slice_sizes, strict=True):
            if buf.lora_b.shape[1] != size or buf.lora_a.shape[2] != base.in_features:
                raise ValueError(
                    f"slot buffers A {tuple(buf.lora_a.shape)} / B {tuple(buf.lora_b.shape)} do "
                    f"not fit a slice of {size} x {base.in_features}"
                )
        self.base = base
        self.buffers = list(buffers)
        self.offsets = base.slice_offsets
        self.backend = backend

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The base's :meth:`~engine.models.fused.FusedLinear.split` (the model calls it)."""
        return self.base.split(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., T, in] -> [..., T, sum out_k]``: one base GEMM plus each slice's deltas."""
        y = self.base(x)
        if torch.compiler.is_compiling():  # every slice's deltas: one opaque op
            torch.ops.loraplex.lora_slices_delta_(  # (engine.runner.compiled_step)
                y.view(-1, y.shape[-1]),
                x.reshape(-1, x.shape[-1]),
                self.layer_idx,
                ",".join(self.base.slice_names),
                list(self.offsets),
            )
            return y
        if self.backend.active:
            flat = y.view(-1, y.shape[-1])
            self.backend.apply_slices(flat, x.reshape(-1, x.shape[-1]), self.buffers, self.offsets)
        return y


def install_lora(
    model: nn.Module, buffers: dict[tuple[int, str], SlotBuffers], backend: LoRABackend
) -> int:
    """Replace the model's LoRA targets (``model.lora_targets()``) with LoRA layers.

    An ``nn.Linear`` target becomes a :class:`LoRALinear`; the slices of a fused projection
    (:class:`~engine.models.fused.LinearSlice`) are grouped, and the fused module becomes one
    :class:`FusedLoRALinear` with each slice's buffers.

    Args:
        model: A model from ``engine.models``.
        buffers: Slot buffers per ``(layer_idx, projection name)``.
        backend: The backend the runner updates before each forward pass.

    Returns:
        The number of projections wrapped (a fused module counts once per slice).

    Raises:
        KeyError: a target has no buffers.
        ValueError: a fused module's slices are not all targets.
    """
    parents = {
        id(child): (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
    }
    count = 0
    fused: dict[int, tuple[FusedLinear, dict[str, SlotBuffers], int]] = {}
    for layer_idx, name, target in list(model.lora_targets()):
        if isinstance(target, LinearSlice):
            _, by_name, _ = fused.setdefault(id(target.fused), (target.fused, {}, layer_idx))
            by_name[target.name] = buffers[(layer_idx, name)]
            continue
        parent, attr = parents[id(target)]
        setattr(
            parent, attr, LoRALinear(target, buffers[(layer_idx, name)], backend, layer_idx, name)
        )
        count += 1
    for base, by_name, layer_idx in fused.values():
        missing = [n for n in base.slice_names if n not in by_name]
        if missing:
            raise ValueError(f"fused projection slices {missing} are not LoRA targets")
        parent, attr = parents[id(base)]
        slot_buffers = [by_name[n] for n in base.slice_names]
        setattr(parent, attr, FusedLoRALinear(base, slot_buffers, backend, layer_idx))
        count += len(slot_buffers)
    return count


def target_shapes(model: nn.Module) -> dict[tuple[int, str], tuple[int, int]]:
    """``(layer_idx, name) -> (in_features, out_features)`` of every LoRA target."""
    return {
        (layer, name): (lin.in_features, lin.out_features)
        for layer, name, lin in model.lora_targets()
    }
