"""The LoRA deltas with the Triton shrink and expand kernels (``kernels.lora_ops``).

Punica's SGMV / vLLM's punica kernels: the step's tokens grouped by slot once (a
``kernels.lora_ops.LoRABatch``, built by :meth:`TritonLoRABackend.update_metadata`), then one
shrink and one expand launch per projection, whatever the number of adapters. On CPU this needs
Triton's interpreter (``TRITON_INTERPRET=1``, tests only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraplex.engine.lora.slots import SlotBuffers
    from loraplex.kernels.lora_ops import LoRABatch

RANK_CACHE_ENTRIES = 64  # distinct per-slot rank lists kept as device tensors


class TritonLoRABackend:
    """See :class:`engine.lora.backend.LoRABackend`; the metadata is the kernels' batch."""

    name = "triton"

    def __init__(self) -> None:
        self.kernel_batch: LoRABatch | None = None
        self.static = False  # kernel_batch is a CUDA graph's fixed batch (set_static_batch)
        self._rank_tensors: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def active(self) -> bool:
        """Whether the step has adapter tokens."""
        if self.static:
            return True
        return self.kernel_batch is not None and bool(self.kernel_batch.slots)

    def update_metadata(self, token_slots: list[int], device: torch.device) -> None:
        """Group the step's tokens by slot for the kernels (``make_lora_batch``)."""
        from loraplex.kernels.lora_ops import make_lora_batch

        self.kernel_batch = make_lora_batch(token_slots, device)
        self.static = False

    def clear(self) -> None:
        """No adapter in the step."""
        self.kernel_batch = None
        self.static = False

    def set_static_batch(self, batch: LoRABatch) -> None:
        """Use a batch of fixed tensors that the caller rewrites in place between steps.

        For CUDA graphs (``engine.runner.cuda_graphs``): the graph captures the kernels'
        launches once, so nothing in :meth:`apply` may depend on the step's slots on the host.
        With a static batch every projection launches its shrink and expand over all of
        ``batch.blocks`` (empty blocks return at once) and reads each slot's rank from the
        projection's ``SlotBuffers.rank_tensor``, which the LoRA manager updates in place.

        Args:
            batch: ``sorted_tokens`` ``[C]`` int32 and ``blocks`` ``[C, 3]`` int32 of a fixed
                capacity ``C``, ``block_m`` fixed; ``slots`` is not read.
        """
        self.kernel_batch = batch
        self.static = True

    def device_ranks(self, ranks: list[int], device: torch.device) -> torch.Tensor:
        """``ranks`` as an int32 device tensor, cached by value (the kernels' per-slot ranks)."""
        key = tuple(ranks)
        found = self._rank_tensors.get(key)
        if found is None or found.device != device:
            if len(self._rank_tensors) >= RANK_CACHE_ENTRIES:  # adapters come and go
                self._rank_tensors.clear()
            found = torch.tensor(key, dtype=torch.int32, device=device)
            self._rank_tensors[key] = found
        return found

    def apply(self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers) -> torch.Tensor:
        """See :class:`engine.lora.backend.LoRABackend`."""
        batch = self.kernel_batch
        if batch is None:
            return y
        if self.static:  # no host decision: the same launches at every replay
            ranks = buffers.rank_tensor
        elif not any(buffers.ranks[s] for s in batch.slots):
            return y  # no adapter of the step targets this projection
        else:
            ranks = self.device_ranks(buffers.ranks, x.device)
        from loraplex.kernels.lora_ops import lora_expand, lora_shrink

        h = lora_shrink(x, buffers.lora_a, batch, ranks)
        return lora_expand(y, h, buffers.lora_b, buffers.scales, batch, ranks)
