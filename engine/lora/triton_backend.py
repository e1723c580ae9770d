"""The LoRA deltas with the Triton shrink and expand kernels (``kernels.lora_ops``).

Punica's SGMV / vLLM's punica kernels: the step's tokens grouped by slot once (a
``kernels.lora_ops.LoRABatch``, built by :meth:`TritonLoRABackend.update_metadata`), then one
shrink and one expand launch per projection, whatever the number of adapters (a fused q/k/v
or gate/up projection included: its slices go to the kernels as one list of stacks). On CPU
this needs
Triton's interpreter (``TRITON_INTERPRET=1``, tests only).
"""

from __future__ import annotations

from collections.abc import Sequence
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
        # Fused layers' pointer tables, by content (pointers, offsets, widths, strides): built
        # once per layer, in eager steps, so a CUDA graph capture copies nothing from the host.
        # Bounded by the model's fused layers (the slot buffers live as long as the engine).
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

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

    def apply_slices(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        buffers: Sequence[SlotBuffers],
        offsets: Sequence[int],
    ) -> torch.Tensor:
        """See :class:`engine.lora.backend.LoRABackend`: one shrink and one expand launch.

        The slices' ``A`` stacks (same shape) and ``B`` stacks (their own widths) go to the
        kernels together with per-slice ranks and scales and the slices' column offsets; a
        slot's rank 0 on a slice (the adapter does not target it) makes the kernels skip it.
        """
        batch = self.kernel_batch
        if batch is None:
            return y
        if self.static:  # no host decision: the same launches at every replay
            ranks = [buf.rank_tensor for buf in buffers]
        elif not any(buf.ranks[s] for buf in buffers for s in batch.slots):
            return y  # no adapter of the step targets any slice
        else:
            ranks = [self.device_ranks(buf.ranks, x.device) for buf in buffers]
        from loraplex.kernels.lora_ops import lora_expand, lora_shrink

        a_stacks = [buf.lora_a for buf in buffers]
        b_stacks = [buf.lora_b for buf in buffers]
        shrink_tab, expand_tab = self.pointer_tables(a_stacks, b_stacks, offsets, x.device)
        h = lora_shrink(x, a_stacks, batch, ranks, table=shrink_tab)
        return lora_expand(
            y,
            h,
            b_stacks,
            [buf.scales for buf in buffers],
            batch,
            ranks,
            offsets=list(offsets),
            table=expand_tab,
        )

    def pointer_tables(
        self,
        a_stacks: list[torch.Tensor],
        b_stacks: list[torch.Tensor],
        offsets: Sequence[int],
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' shrink and expand tables for a fused layer, built once and kept.

        Keyed by what the tables hold (pointers, offsets, widths, strides), so a cached table
        is always the right one. A CUDA graph's warm-up runs build them before its capture.
        """
        from loraplex.kernels.lora_ops import expand_table, shrink_table

        key = (
            str(device),
            tuple(a.data_ptr() for a in a_stacks),
            tuple((b.data_ptr(), b.shape[1], b.stride(0)) for b in b_stacks),
            tuple(offsets),
        )
        found = self._tables.get(key)
        if found is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "a fused LoRA layer's pointer tables were not built before the CUDA graph "
                    "capture (its warm-up runs should have built them)"
                )
            found = (shrink_table(a_stacks, device), expand_table(b_stacks, offsets, device))
            self._tables[key] = found
        return found
