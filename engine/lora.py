"""Per-request LoRA deltas in one batch (Punica / S-LoRA semantics), plain-torch implementation.

Every token of a step carries the device slot of its request's adapter (-1: the base model).
Each targeted projection adds, for token ``i`` with slot ``s = token_slots[i]``::

    y[i] += scale[s] * (x[i] @ A[s].T) @ B[s].T          (shrink, then expand)

with the stacked slot buffers ``A: [max_loras, max_rank, in]`` and ``B: [max_loras, out,
max_rank]`` (ranks below ``max_rank`` are zero-padded; the slot's own rank is sliced off so
padding costs nothing). Tokens are grouped by slot once per step, so the work is one shrink and
one expand per distinct adapter and projection, never a Python loop per token. With the triton
attention backend (``LoRAStepContext.use_triton``, set by the model runner) :func:`add_lora`
runs the Triton shrink/expand of :mod:`kernels.lora_ops` instead: one launch each per
projection, whatever the number of adapters.

Source: Chen et al., "Punica: Multi-Tenant LoRA Serving" (MLSys 2024), SGMV semantics
``y[s[i]:s[i+1]] += x @ A.T @ B.T``; Sheng et al., "S-LoRA" (MLSys 2024).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from loraplex.adapters.manager import slot_view

if TYPE_CHECKING:
    from loraplex.kernels.lora_ops import LoRABatch


@dataclass
class LoRASlotBuffers:
    """The stacked device weights of one targeted projection, shared with the LoRA manager.

    Attributes:
        lora_a: ``[max_loras, max_rank, in_features]``.
        lora_b: ``[max_loras, out_features, max_rank]``.
        scales: ``[max_loras]`` float32: ``alpha / r`` (or ``alpha / sqrt(r)`` with rsLoRA),
            0 where the slot's adapter does not target this projection.
        ranks: Host list, the rank of each slot's adapter for this projection (0: none).
        host_scales: Host list, ``scales`` again (no device read on the per-slot path).
        views: Host list, per slot ``(A[s, :r].T, B[s, :, :r].T, scale)`` views of the
            buffers (None: rank 0), made once when a slot is loaded so the per-slot path
            does no indexing per step (see :func:`slot_view`).
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scales: torch.Tensor
    ranks: list[int]
    host_scales: list[float] = field(default_factory=list)
    views: list[tuple[torch.Tensor, torch.Tensor, float] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.host_scales:
            self.host_scales = [float(s) for s in self.scales.tolist()]
        if not self.views:
            self.views = [
                slot_view(self.lora_a, self.lora_b, s, r, self.host_scales[s])
                for s, r in enumerate(self.ranks)
            ]


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
        use_triton: Run the Triton kernels (set once by the model runner with the triton
            attention backend); then ``kernel_batch`` replaces the torch paths' indices.
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
    use_triton: bool = False
    kernel_batch: LoRABatch | None = None
    _rank_tensors: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

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
    buffers: LoRASlotBuffers,
    context: LoRAStepContext,
) -> torch.Tensor:
    """Add every token's LoRA delta to a projection's output, in place.

    Two exact implementations of the same semantics: segments (the adapter tokens gathered
    once sorted by slot, a shrink and an expand per slot on contiguous views, one scatter
    back), or, past ``BATCHED_MIN_SLOTS`` adapters with little padding, one batched shrink and
    one batched expand over the tokens grouped per slot and zero-padded
    (``[S, n_max, in] x [S, in, R]``).

    Args:
        y: ``[T, out]`` the base projection's output.
        x: ``[T, in]`` its input.
        buffers: The projection's stacked slot weights.
        context: The step's slot grouping.

    Returns:
        ``y``, with ``y[i] += scale[s] * (x[i] @ A[s, :r].T) @ B[s, :, :r].T`` for each token.
    """
    batch = context.kernel_batch
    if batch is not None:  # Triton: one shrink and one expand launch for every adapter
        if not any(buffers.ranks[s] for s in batch.slots):
            return y  # no adapter of the step targets this projection
        from loraplex.kernels.lora_ops import lora_expand, lora_shrink

        ranks = context.device_ranks(buffers.ranks, x.device)
        h = lora_shrink(x, buffers.lora_a, batch, ranks)
        return lora_expand(y, h, buffers.lora_b, buffers.scales, batch, ranks)
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
    # Segment path (SGMV-style): gather the adapter tokens once, sorted by slot, then one
    # shrink and one expand per slot on contiguous views, and one scatter back.
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


class LoRALinear(nn.Module):
    """A base ``nn.Linear`` plus the per-token LoRA delta of the step's adapters.

    Args:
        base: The projection (its weights stay as loaded).
        buffers: This projection's stacked slot weights.
        context: The step context shared by every LoRA layer of the model.
    """

    def __init__(self, base: nn.Linear, buffers: LoRASlotBuffers, context: LoRAStepContext):
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
    model: nn.Module, buffers: dict[tuple[int, str], LoRASlotBuffers], context: LoRAStepContext
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
