"""The LoRA backends: how a step's per-token adapter deltas are computed (one interface).

Every targeted projection adds, for token ``i`` of adapter slot ``s``::

    y[i] += scale[s] * (x[i] @ A[s, :r].T) @ B[s, :, :r].T      (shrink, then expand)

:class:`TorchLoRABackend` computes it with torch ops (CPU, and any device without Triton);
:class:`TritonLoRABackend` with the Triton shrink/expand kernels of :mod:`kernels.lora_ops`
(Punica's SGMV / vLLM's punica kernels: one launch each per projection, whatever the number of
adapters). One backend is chosen per engine, once, by :func:`select_lora_backend`, and every
LoRA layer of the model uses it through its ``engine.lora.LoRAStepContext``.

Source: Chen et al., "Punica: Multi-Tenant LoRA Serving" (MLSys 2024); Sheng et al.,
"S-LoRA" (MLSys 2024).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from loraplex.adapters.manager import SlotBuffers
    from loraplex.engine.lora import LoRAStepContext


class LoRABackend(Protocol):
    """Computes LoRA deltas for one projection of one step.

    Attributes:
        name: ``"torch"`` or ``"triton"``.
    """

    name: str

    def apply(
        self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers, context: LoRAStepContext
    ) -> torch.Tensor:
        """Add every token's delta to ``y`` (``[T, out]``) from ``x`` (``[T, in]``), in place.

        Returns:
            ``y``.
        """
        ...


class TorchLoRABackend:
    """The deltas with torch ops, exact, by whichever of three layouts the step has.

    - **contiguous** (the scheduler groups a step's sequences by adapter, so this is the usual
      case): each slot's tokens are one run of rows; a shrink and an expand per slot on views,
      added in place (``addmm_``), no gather or scatter;
    - **batched** (more than ``BATCHED_MIN_SLOTS`` adapters, scattered, little padding): the
      tokens grouped per slot and zero-padded, one ``bmm`` shrink and one ``bmm`` expand;
    - **segments** (scattered otherwise): the adapter tokens gathered once sorted by slot, a
      shrink and an expand per slot, one scatter back.
    """

    name = "torch"

    def apply(
        self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers, context: LoRAStepContext
    ) -> torch.Tensor:
        """See :class:`LoRABackend`."""
        if context.contiguous:  # SGMV layout: each slot's tokens are rows [start, end) already
            views = buffers.views
            for slot, start, end in context.segments:
                view = views[slot]
                if view is not None:
                    a_t, b_t, scale = view
                    y[start:end].addmm_(x[start:end] @ a_t, b_t, alpha=scale)  # shrink, expand
            return y
        if context.slot_ids is not None:
            slots = context.slot_ids
            xg = x[context.padded_index]  # [S, n, in]
            a = buffers.lora_a.index_select(0, slots)  # [S, R, in] (zero past each rank)
            b = buffers.lora_b.index_select(0, slots)  # [S, out, R]
            h = torch.bmm(xg, a.transpose(1, 2).to(xg.dtype))  # shrink: [S, n, R]
            delta = torch.bmm(h, b.transpose(1, 2).to(h.dtype))  # expand: [S, n, out]
            delta = delta * buffers.scales.index_select(0, slots)[:, None, None].to(delta.dtype)
            flat = delta.reshape(-1, delta.shape[-1])[context.valid]
            y.index_add_(0, context.flat_index, flat.to(y.dtype))
            return y
        xs = x.index_select(0, context.perm)  # [N, in]
        delta = x.new_zeros((xs.shape[0], y.shape[1]))  # [N, out]
        for slot, start, end in context.segments:
            rank = buffers.ranks[slot]
            if rank == 0:
                continue
            h = xs[start:end] @ buffers.lora_a[slot, :rank].T  # shrink: [n, r]
            seg = delta[start:end]
            torch.matmul(h, buffers.lora_b[slot, :, :rank].T, out=seg)  # expand: [n, out]
            seg.mul_(buffers.scales[slot])
        y.index_add_(0, context.perm, delta.to(y.dtype))
        return y


class TritonLoRABackend:
    """The deltas with the Triton shrink and expand kernels (``kernels.lora_ops``).

    The step's ``LoRABatch`` (tokens grouped by slot) is built once per step by
    ``LoRAStepContext.set_token_slots``; each projection is then one shrink and one expand
    launch. On CPU this needs Triton's interpreter (``TRITON_INTERPRET=1``, tests only).
    """

    name = "triton"

    def apply(
        self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers, context: LoRAStepContext
    ) -> torch.Tensor:
        """See :class:`LoRABackend`."""
        batch = context.kernel_batch
        if batch is None or not any(buffers.ranks[s] for s in batch.slots):
            return y  # no adapter of the step targets this projection
        from loraplex.kernels.lora_ops import lora_expand, lora_shrink

        ranks = context.device_ranks(buffers.ranks, x.device)
        h = lora_shrink(x, buffers.lora_a, batch, ranks)
        return lora_expand(y, h, buffers.lora_b, buffers.scales, batch, ranks)


def select_lora_backend(attention_backend: str) -> LoRABackend:
    """The LoRA backend of an engine: Triton with the Triton attention backend, else torch.

    The one place the choice is made (``EngineCore`` calls it when it builds the model).

    Raises:
        ValueError: an unknown attention backend name.
    """
    if attention_backend == "triton":
        return TritonLoRABackend()
    if attention_backend == "torch":
        return TorchLoRABackend()
    raise ValueError(f"unknown attention backend {attention_backend!r}")
