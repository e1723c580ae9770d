"""The LoRA deltas with torch ops: exact, on any device, by whichever of three layouts fits.

- **contiguous** (the scheduler groups a step's sequences by adapter, so this is the usual
  case): each slot's tokens are one run of rows; a shrink and an expand per slot on views,
  added in place (``addmm_``), no gather or scatter (Punica's SGMV layout);
- **batched** (more than ``BATCHED_MIN_SLOTS`` adapters, scattered, little padding): the
  tokens grouped per slot and zero-padded, one ``bmm`` shrink and one ``bmm`` expand;
- **segments** (scattered otherwise): the adapter tokens gathered once sorted by slot, a
  shrink and an expand per slot, one scatter back.

The layout and its index tensors are the step's metadata, built once per step by
:meth:`TorchLoRABackend.update_metadata` and read by every projection's :meth:`apply`. A fused
projection (:meth:`TorchLoRABackend.apply_slices`) applies each slice on its own column view of
the fused output, so each slice's delta is computed exactly as for a separate projection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraplex.engine.lora.slots import SlotBuffers

BATCHED_MIN_SLOTS = 2  # above this many adapters in a step, one padded bmm beats a slot loop


class TorchLoRABackend:
    """See :class:`engine.lora.backend.LoRABackend`.

    Attributes (the step's metadata):
        contiguous: Every slot's tokens form one run of the step's tokens: ``segments`` are
            then token ranges and the deltas are added in place.
        segments: ``(slot, start, end)`` token ranges per slot when ``contiguous``, else
            ranges of ``perm``.
        perm: ``[N]`` int64, the step's adapter tokens sorted by slot (segments layout).
        slot_ids: ``[S]`` int64, the step's slots (batched layout, else None).
        padded_index: ``[S, n_max]`` int64 token indices per slot, padded with 0.
        valid: ``[S * n_max]`` bool, which padded entries are real tokens.
        flat_index: ``[sum n]`` int64 token index of each valid entry, in ``valid`` order.
    """

    name = "torch"

    def __init__(self, batched: bool | None = None) -> None:
        """Make a backend with no step prepared.

        Args:
            batched: Force the batched (True) or segments (False) layout for scattered slots;
                None picks batched only past ``BATCHED_MIN_SLOTS`` adapters and when padding
                every slot's tokens to the largest group at most doubles them (with Zipf
                popularity one adapter dominates and the loop is faster: ``bench.multi_lora``).
        """
        self.batched = batched
        self.clear()

    @property
    def active(self) -> bool:
        """Whether the step has adapter tokens."""
        return bool(self.segments)

    def clear(self) -> None:
        """No adapter in the step."""
        self.contiguous = False
        self.segments: list[tuple[int, int, int]] = []
        self.perm: torch.Tensor | None = None
        self.slot_ids: torch.Tensor | None = None
        self.padded_index: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.flat_index: torch.Tensor | None = None

    def update_metadata(self, token_slots: list[int], device: torch.device) -> None:
        """Group the step's tokens by slot and pick the layout (see the module docstring)."""
        self.clear()
        by_slot: dict[int, list[int]] = {}
        runs: list[tuple[int, int, int]] = []  # (slot, start, end) of each run of one slot
        prev = -1
        for i, s in enumerate(token_slots):
            if s >= 0:
                by_slot.setdefault(s, []).append(i)
                if s == prev:
                    runs[-1] = (s, runs[-1][1], i + 1)
                else:
                    runs.append((s, i, i + 1))
            prev = s
        self.contiguous = len(runs) == len(by_slot)
        if self.contiguous:
            self.segments = runs
            return
        order: list[int] = []
        for s, idx in by_slot.items():
            self.segments.append((s, len(order), len(order) + len(idx)))
            order.extend(idx)
        self.perm = torch.tensor(order, dtype=torch.long, device=device)
        width = max(len(idx) for idx in by_slot.values())
        batched = self.batched
        if batched is None:
            used = len(order)
            batched = len(by_slot) > BATCHED_MIN_SLOTS and len(by_slot) * width <= 2 * used
        if batched:
            padded = [idx + [0] * (width - len(idx)) for idx in by_slot.values()]
            valid = [[True] * len(idx) + [False] * (width - len(idx)) for idx in by_slot.values()]
            self.slot_ids = torch.tensor(list(by_slot), dtype=torch.long, device=device)
            self.padded_index = torch.tensor(padded, dtype=torch.long, device=device)
            self.valid = torch.tensor(valid, device=device).reshape(-1)
            self.flat_index = self.padded_index.reshape(-1)[self.valid]

    def apply(self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers) -> torch.Tensor:
        """See :class:`engine.lora.backend.LoRABackend`."""
        if self.contiguous:  # SGMV layout: each slot's tokens are rows [start, end) already
            views = buffers.views
            for slot, start, end in self.segments:
                view = views[slot]
                if view is not None:
                    a_t, b_t, scale = view
                    y[start:end].addmm_(x[start:end] @ a_t, b_t, alpha=scale)  # shrink, expand
            return y
        if self.slot_ids is not None:
            slots = self.slot_ids
            xg = x[self.padded_index]  # [S, n, in]
            a = buffers.lora_a.index_select(0, slots)  # [S, R, in] (zero past each rank)
            b = buffers.lora_b.index_select(0, slots)  # [S, out, R]
            h = torch.bmm(xg, a.transpose(1, 2).to(xg.dtype))  # shrink: [S, n, R]
            delta = torch.bmm(h, b.transpose(1, 2).to(h.dtype))  # expand: [S, n, out]
            delta = delta * buffers.scales.index_select(0, slots)[:, None, None].to(delta.dtype)
            flat = delta.reshape(-1, delta.shape[-1])[self.valid]
            y.index_add_(0, self.flat_index, flat.to(y.dtype))
            return y
        xs = x.index_select(0, self.perm)  # [N, in]
        delta = x.new_zeros((xs.shape[0], y.shape[1]))  # [N, out]
        for slot, start, end in self.segments:
            rank = buffers.ranks[slot]
            if rank == 0:
                continue
            h = xs[start:end] @ buffers.lora_a[slot, :rank].T  # shrink: [n, r]
            seg = delta[start:end]
            torch.matmul(h, buffers.lora_b[slot, :, :rank].T, out=seg)  # expand: [n, out]
            seg.mul_(buffers.scales[slot])
        y.index_add_(0, self.perm, delta.to(y.dtype))
        return y

    def apply_slices(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        buffers: Sequence[SlotBuffers],
        offsets: Sequence[int],
    ) -> torch.Tensor:
        """See :class:`engine.lora.backend.LoRABackend`: :meth:`apply` per slice, on views."""
        for buf, offset in zip(buffers, offsets, strict=True):
            if any(buf.ranks[slot] for slot, _, _ in self.segments):
                self.apply(y[:, offset : offset + buf.lora_b.shape[1]], x, buf)
        return y
