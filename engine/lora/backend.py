"""The LoRA backend interface: how a step's per-token adapter deltas are prepared and computed.

Every targeted projection adds, for token ``i`` of adapter slot ``s``::

    y[i] += scale[s] * (x[i] @ A[s, :r].T) @ B[s, :, :r].T      (shrink, then expand)

A backend is chosen once per engine (:func:`select_lora_backend`) and shared by every LoRA layer
of the model. Before each forward pass the model runner hands it the step's token-to-slot map
(:meth:`LoRABackend.update_metadata`, vLLM's ``PunicaWrapper.update_metadata``); the backend
builds whatever per-step metadata its arithmetic needs (index tensors for torch, the kernels'
``LoRABatch`` for Triton), and each layer then calls :meth:`LoRABackend.apply`. Nothing outside
a backend knows which one it is.

Source: Chen et al., "Punica: Multi-Tenant LoRA Serving" (MLSys 2024); Sheng et al.,
"S-LoRA" (MLSys 2024).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from loraplex.engine.lora.slots import SlotBuffers


@runtime_checkable
class LoRABackend(Protocol):
    """Prepares a step's LoRA metadata and computes each projection's deltas.

    Attributes:
        name: ``"torch"`` or ``"triton"``.
    """

    name: str

    @property
    def active(self) -> bool:
        """Whether any token of the current step uses an adapter."""
        ...

    def update_metadata(self, token_slots: list[int], device: torch.device) -> None:
        """Prepare the step: ``token_slots[i]`` is the slot of token ``i`` (-1: no adapter).

        Args:
            token_slots: One entry per token of the step's flattened batch (``[T]``).
            device: Where the step's index tensors go.
        """
        ...

    def clear(self) -> None:
        """A step with no adapter: :attr:`active` is False until the next update."""
        ...

    def apply(self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers) -> torch.Tensor:
        """Add every token's delta to ``y`` (``[T, out]``) from ``x`` (``[T, in]``), in place.

        Args:
            y: The base projection's output.
            x: Its input.
            buffers: The projection's stacked slot weights (``engine.lora.slots``).

        Returns:
            ``y``.
        """
        ...

    def apply_slices(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        buffers: Sequence[SlotBuffers],
        offsets: Sequence[int],
    ) -> torch.Tensor:
        """A fused projection's deltas: slice ``k``'s into ``y[:, offsets[k] : + out_k]``.

        Each slice is exactly :meth:`apply` on its own columns (its own ranks and scales; a
        slot that does not target the slice adds nothing there).

        Args:
            y: ``[T, sum out_k]`` the fused projection's output, modified in place.
            x: ``[T, in]`` its input (shared by every slice).
            buffers: Each slice's slot weights, ``lora_b`` ``[max_loras, out_k, max_rank]``.
            offsets: Each slice's first column in ``y``.

        Returns:
            ``y``.
        """
        ...


def select_lora_backend(attention_backend: str) -> LoRABackend:
    """The LoRA backend of an engine: Triton with the Triton attention backend, else torch.

    The one place the choice is made (``EngineCore`` calls it when it builds the model); the
    Triton module is imported only when it is chosen.

    Raises:
        ValueError: an unknown attention backend name.
    """
    if attention_backend == "triton":
        from loraplex.engine.lora.triton_backend import TritonLoRABackend

        return TritonLoRABackend()
    if attention_backend == "torch":
        from loraplex.engine.lora.torch_backend import TorchLoRABackend

        return TorchLoRABackend()
    raise ValueError(f"unknown attention backend {attention_backend!r}")
