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

Source: Chen et al., "Punica: Multi-Tenant LoRA Serving" (MLSys 2024), SGMV semantics
``y[s[i]:s[i+1]] += x @ A.T @ B.T``; Sheng et al., "S-LoRA" (MLSys 2024).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from loraplex.engine.lora.backend import LoRABackend
    from loraplex.engine.lora.slots import SlotBuffers


class LoRALinear(nn.Module):
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

    @property
    def weight(self) -> torch.Tensor:
        """The base weight (``[out, in]``)."""
        return self.base.weight

    @property
    def in_features(self) -> int:
        """The base projection's input size."""
        return self.base.in_features

    @property
    def out_features(self) -> int:
        """The base projection's output size."""
        return self.base.out_features

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


def install_lora(
    model: nn.Module, buffers: dict[tuple[int, str], SlotBuffers], backend: LoRABackend
) -> int:
    """Replace the model's LoRA targets (``model.lora_targets()``) with :class:`LoRALinear`.

    Args:
        model: A model from ``engine.models``.
        buffers: Slot buffers per ``(layer_idx, projection name)``.
        backend: The backend the runner updates before each forward pass.

    Returns:
        The number of projections wrapped.

    Raises:
        KeyError: a target has no buffers.
    """
    parents = {
        id(child): (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
    }
    count = 0
    for layer_idx, name, linear in list(model.lora_targets()):
        parent, attr = parents[id(linear)]
        setattr(
            parent, attr, LoRALinear(linear, buffers[(layer_idx, name)], backend, layer_idx, name)
        )
        count += 1
    return count


def target_shapes(model: nn.Module) -> dict[tuple[int, str], tuple[int, int]]:
    """``(layer_idx, name) -> (in_features, out_features)`` of every LoRA target."""
    return {
        (layer, name): (lin.in_features, lin.out_features)
        for layer, name, lin in model.lora_targets()
    }
