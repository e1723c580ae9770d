"""Per-request LoRA deltas in one batch (Punica / S-LoRA semantics), plain-torch implementation.

Every token of a step carries the device slot of its request's adapter (-1: the base model).
Each targeted projection adds, for token ``i`` with slot ``s = token_slots[i]``::

    y[i] += scale[s] * (x[i] @ A[s].T) @ B[s].T          (shrink, then expand)

with the stacked slot buffers ``A: [max_loras, max_rank, in]`` and ``B: [max_loras, out,
max_rank]`` (ranks below ``max_rank`` are zero-padded; the slot's own rank is sliced off so
padding costs nothing). Tokens are grouped by slot once per step, so the work is one shrink and
one expand per distinct adapter and projection, never a Python loop per token. The arithmetic lives
in one :class:`engine.lora_backend.LoRABackend`, chosen once per engine: the torch one (the
paths above) or the Triton one (the shrink/expand of :mod:`kernels.lora_ops`: one launch each
per projection, whatever the number of adapters).

Source: Chen et al., "Punica: Multi-Tenant LoRA Serving" (MLSys 2024), SGMV semantics
``y[s[i]:s[i+1]] += x @ A.T @ B.T``; Sheng et al., "S-LoRA" (MLSys 2024).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from loraplex.adapters.manager import SlotBuffers
from loraplex.engine.lora_backend import LoRABackend, TorchLoRABackend

if TYPE_CHECKING:
    from loraplex.kernels.lora_ops import LoRABatch


@dataclass
class LoRAStepContext:
    """The step's token-to-slot mapping, set by the model runner before each forward pass.

    Attributes:
        groups: ``(slot, token indices [n] int64)`` for every adapter slot in the step when the
            slots are not ``contiguous`` (else empty: ``segments`` say it all).
        contiguous: Every slot's tokens form one run of the step's tokens (the scheduler
            groups sequences by adapter, so this is the usual case): ``segments`` are then
            token ranges and the deltas are added in place, with no gather or scatter.
        perm: ``[N]`` int64, the step's adapter tokens sorted by slot (segment path when the
            slots are not contiguous).
        segments: ``(slot, start, end)`` token ranges per slot when ``contiguous``, else
            ranges of ``perm``.
        slot_ids: ``[S]`` int64, the step's slots (batched path; see :func:`add_lora`).
        padded_index: ``[S, n_max]`` int64 token indices per slot, padded with 0.
        valid: ``[S * n_max]`` bool, which padded entries are real tokens.
        flat_index: ``[sum n]`` int64 token index of each valid entry, in ``valid`` order.
        backend: Computes the deltas (``engine.lora_backend``: torch or Triton), chosen once
            when the engine is built; with Triton, ``kernel_batch`` replaces the torch paths'
            indices.
        kernel_batch: The step's ``kernels.lora_ops.LoRABatch`` (Triton path).
    """

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    contiguous: bool = False
    perm: torch.Tensor | None = None
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    slot_ids: torch.Tensor | None = None
    padded_index: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    flat_index: torch.Tensor | None = None
    backend: LoRABackend = field(default_factory=TorchLoRABackend)
    kernel_batch: LoRABatch | None = None
    _rank_tensors: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    @property
    def use_triton(self) -> bool:
        """Whether the backend is the Triton one (its per-step batch is built here)."""
        return self.backend.name == "triton"

    def set_token_slots(
        self, token_slots: list[int], device: torch.device, batched: bool | None = None
    ) -> None:
        """Group the step's tokens by slot (``token_slots[i]`` = slot of token ``i``, -1 none).

        Args:
            token_slots: Slot of each of the step's tokens.
            device: Where the index tensors go.
            batched: Force the batched (True) or per-slot (False) path of :func:`add_lora`;
                None picks batched only past ``BATCHED_MIN_SLOTS`` adapters and when
                zero-padding every slot's tokens to the largest group at most doubles them
                (with Zipf popularity one adapter dominates and the loop is faster: measured
                in ``bench.multi_lora``).
        """
        if self.use_triton:
            from loraplex.kernels.lora_ops import make_lora_batch

            self.kernel_batch = make_lora_batch(token_slots, device)
            batched = False
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
        self.contiguous = len(runs) == len(by_slot) and not self.use_triton
        if self.contiguous:
            self.groups = []  # not needed: the segments are the token ranges
            self.segments = runs
            self.perm = None
            self.slot_ids = self.padded_index = self.valid = self.flat_index = None
            return
        self.groups = [
            (s, torch.tensor(idx, dtype=torch.long, device=device)) for s, idx in by_slot.items()
        ]
        order: list[int] = []
        self.segments = []
        for s, idx in by_slot.items():
            self.segments.append((s, len(order), len(order) + len(idx)))
            order.extend(idx)
        self.perm = torch.tensor(order, dtype=torch.long, device=device) if order else None
        width = max((len(idx) for idx in by_slot.values()), default=0)
        if batched is None:
            used = sum(len(idx) for idx in by_slot.values())
            batched = len(by_slot) > BATCHED_MIN_SLOTS and len(by_slot) * width <= 2 * used
        if batched and by_slot:
            padded = [idx + [0] * (width - len(idx)) for idx in by_slot.values()]
            valid = [[True] * len(idx) + [False] * (width - len(idx)) for idx in by_slot.values()]
            self.slot_ids = torch.tensor(list(by_slot), dtype=torch.long, device=device)
            self.padded_index = torch.tensor(padded, dtype=torch.long, device=device)
            self.valid = torch.tensor(valid, device=device).reshape(-1)
            self.flat_index = self.padded_index.reshape(-1)[self.valid]
        else:
            self.slot_ids = self.padded_index = self.valid = self.flat_index = None

    @property
    def active(self) -> bool:
        """Whether any token of the step uses an adapter (else the LoRA layers cost nothing)."""
        return bool(self.segments) or bool(self.groups)

    def clear(self) -> None:
        """No adapter in the step."""
        self.groups = []
        self.contiguous = False
        self.perm = None
        self.segments = []
        self.slot_ids = self.padded_index = self.valid = self.flat_index = None
        self.kernel_batch = None

    def device_ranks(self, ranks: list[int], device: torch.device) -> torch.Tensor:
        """``ranks`` as an int32 device tensor, cached by value (the kernels' per-slot ranks)."""
        key = tuple(ranks)
        found = self._rank_tensors.get(key)
        if found is None or found.device != device:
            if len(self._rank_tensors) >= 64:  # adapters come and go: keep the cache small
                self._rank_tensors.clear()
            found = torch.tensor(key, dtype=torch.int32, device=device)
            self._rank_tensors[key] = found
        return found


BATCHED_MIN_SLOTS = 2  # above this many adapters in a step, one padded bmm beats a slot loop


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    buffers: SlotBuffers,
    context: LoRAStepContext,
) -> torch.Tensor:
    """Add every token's LoRA delta to a projection's output, in place.

    The context's backend (``engine.lora_backend``: torch or Triton, chosen once per engine)
    does the arithmetic.

    Args:
        y: ``[T, out]`` the base projection's output.
        x: ``[T, in]`` its input.
        buffers: The projection's stacked slot weights.
        context: The step's slot grouping.

    Returns:
        ``y``, with ``y[i] += scale[s] * (x[i] @ A[s, :r].T) @ B[s, :, :r].T`` for each token.
    """
    return context.backend.apply(y, x, buffers, context)


class LoRALinear(nn.Module):
    """A base ``nn.Linear`` plus the per-token LoRA delta of the step's adapters.

    Args:
        base: The projection (its weights stay as loaded).
        buffers: This projection's stacked slot weights.
        context: The step context shared by every LoRA layer of the model.
    """

    def __init__(self, base: nn.Linear, buffers: SlotBuffers, context: LoRAStepContext):
        super().__init__()
        self.base = base
        self.buffers = buffers
        self.context = context

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
        """``[T, in] -> [T, out]``: base projection plus LoRA deltas."""
        y = self.base(x)
        if self.context.active:
            add_lora(y, x, self.buffers, self.context)
        return y


def install_lora(
    model: nn.Module, buffers: dict[tuple[int, str], SlotBuffers], context: LoRAStepContext
) -> int:
    """Replace the model's LoRA targets (``model.lora_targets()``) with :class:`LoRALinear`.

    Args:
        model: A model from ``engine.models``.
        buffers: Slot buffers per ``(layer_idx, projection name)``.
        context: The step context the runner sets before each forward pass.

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
        setattr(parent, attr, LoRALinear(linear, buffers[(layer_idx, name)], context))
        count += 1
    return count


def target_shapes(model: nn.Module) -> dict[tuple[int, str], tuple[int, int]]:
    """``(layer_idx, name) -> (in_features, out_features)`` of every LoRA target."""
    return {
        (layer, name): (lin.in_features, lin.out_features)
        for layer, name, lin in model.lora_targets()
    }
