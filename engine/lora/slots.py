"""The LoRA weight manager: a CPU tier and device slots, each LRU (after S-LoRA).

S-LoRA (Sheng et al., MLSys 2024) pages adapter weights between host and device; this is the
simplified version: whole adapters, LRU at both tiers.

Adapters live on disk (the content-addressed store), in a host-memory tier of at most
``max_cpu_loras`` validated adapters, and in ``max_loras`` device slots of stacked buffers (one
``[max_loras, max_rank, in]`` / ``[max_loras, out, max_rank]`` pair per targeted projection, so
mixed ranks share one launch). A slot holding an adapter that a running sequence uses is never
evicted: :meth:`LoRAManager.acquire` returns None instead, and the scheduler waits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from loraplex.adapters.errors import AdapterError

AdapterLoader = Callable[[str], Any]
"""``digest -> LoraAdapter`` (reads the store; raises AdapterError or KeyError)."""


def slot_view(
    lora_a: torch.Tensor, lora_b: torch.Tensor, slot: int, rank: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """The shrink and expand operands of one slot as views of the stacked buffers.

    Args:
        lora_a: ``[max_loras, max_rank, in]``.
        lora_b: ``[max_loras, out, max_rank]``.
        slot: The slot.
        rank: Its adapter's rank for this projection (0: not targeted).
        scale: Its scaling.

    Returns:
        ``(A[slot, :rank].T [in, rank], B[slot, :, :rank].T [rank, out], scale)``, views that
        follow later in-place writes to the buffers; None for rank 0.
    """
    if rank == 0:
        return None
    return lora_a[slot, :rank].T, lora_b[slot, :, :rank].T, scale


class SlotBuffers:
    """One projection's stacked slot weights (the LoRA manager writes, the backends read).

    Attributes:
        lora_a: ``[max_loras, max_rank, in_features]``.
        lora_b: ``[max_loras, out_features, max_rank]``.
        scales: ``[max_loras]`` float32.
        host_scales: Host list, the same scales (the per-slot path passes them as ``alpha``
            without a device read).
        ranks: Host list: each slot's rank for this projection (0: not targeted / empty).
        rank_tensor: ``[max_loras]`` int32 on the device, the same ranks, updated in place
            (a captured CUDA graph reads it at every replay: ``engine.runner.cuda_graphs``).
        views: Host list: each slot's :func:`slot_view` (None: rank 0).
    """

    def __init__(
        self,
        max_loras: int,
        max_rank: int,
        in_features: int,
        out_features: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.lora_a = torch.zeros(max_loras, max_rank, in_features, device=device, dtype=dtype)
        self.lora_b = torch.zeros(max_loras, out_features, max_rank, device=device, dtype=dtype)
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.host_scales = [0.0] * max_loras
        self.ranks = [0] * max_loras
        self.rank_tensor = torch.zeros(max_loras, dtype=torch.int32, device=device)
        self.views: list[tuple[torch.Tensor, torch.Tensor, float] | None] = [None] * max_loras

    @classmethod
    def of(
        cls, lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor, ranks: list[int]
    ) -> SlotBuffers:
        """Buffers over given stacked weights, with their host scales and views.

        Args:
            lora_a: ``[S, R, in]``.
            lora_b: ``[S, out, R]``.
            scales: ``[S]`` float32.
            ranks: Each slot's rank (0: none).
        """
        buffers = cls.__new__(cls)
        buffers.lora_a, buffers.lora_b, buffers.scales = lora_a, lora_b, scales
        buffers.ranks = list(ranks)
        buffers.rank_tensor = torch.tensor(buffers.ranks, dtype=torch.int32, device=lora_a.device)
        buffers.host_scales = [float(s) for s in scales.tolist()]
        buffers.views = [
            slot_view(lora_a, lora_b, s, r, buffers.host_scales[s]) for s, r in enumerate(ranks)
        ]
        return buffers


class LoRAManager:
    """Adapters in host memory and device slots.

    Args:
        target_shapes: ``(layer_idx, projection) -> (in_features, out_features)`` of every
            projection an adapter may target.
        max_loras: Device slots.
        max_cpu_loras: Adapters kept validated in host memory (>= ``max_loras``).
        max_rank: Largest rank a slot holds.
        device: Where the slot buffers live.
        dtype: Their dtype (the model's).
        loader: Reads an adapter by digest when it is in neither tier.

    Raises:
        ValueError: bad sizes.
    """

    def __init__(
        self,
        target_shapes: dict[tuple[int, str], tuple[int, int]],
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        loader: AdapterLoader,
    ) -> None:
        if not 0 < max_loras <= max_cpu_loras or max_rank <= 0:
            raise ValueError("need 0 < max_loras <= max_cpu_loras and max_rank > 0")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_rank = max_rank
        self.loader = loader
        self.buffers = {
            key: SlotBuffers(max_loras, max_rank, i, o, device, dtype)
            for key, (i, o) in target_shapes.items()
        }
        self._cpu: OrderedDict[str, Any] = OrderedDict()  # digest -> LoraAdapter, LRU order
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # resident digests, LRU order
        self._refs = [0] * max_loras
        self._free_slots = list(range(max_loras - 1, -1, -1))
        self.num_loads = 0  # adapters copied into a device slot
        # Called with (digest, True) when an adapter enters a device slot and (digest, False)
        # when it leaves one (a router mirrors residency: engine.kv_cache.events); None: nobody.
        self.on_residency: Callable[[str, bool], None] | None = None

    # --------------------------------------------------------------------------- tiers
    def add(self, adapter: Any) -> None:
        """Put a validated adapter in the CPU tier (most recently used)."""
        self._cpu[adapter.digest] = adapter
        self._cpu.move_to_end(adapter.digest)
        self._trim_cpu()

    def _trim_cpu(self) -> None:
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)  # the store still has it; reloaded on demand

    def _get(self, digest: str) -> Any:
        adapter = self._cpu.get(digest)
        if adapter is None:
            adapter = self.loader(digest)
            self._cpu[digest] = adapter
        self._cpu.move_to_end(digest)
        self._trim_cpu()
        return adapter

    def holds(self, digest: str) -> bool:
        """True when ``digest`` is in the CPU tier or a device slot."""
        return digest in self._cpu or digest in self._slot_of

    def slot_of(self, digest: str) -> int | None:
        """The device slot holding ``digest``, or None."""
        return self._slot_of.get(digest)

    @property
    def slots_in_use(self) -> int:
        """Slots a running sequence holds."""
        return sum(1 for r in self._refs if r > 0)

    @property
    def device_digests(self) -> list[str]:
        """Digests resident in a device slot, least recently used first."""
        return list(self._slot_of)

    @property
    def cpu_digests(self) -> list[str]:
        """Digests in the CPU tier, least recently used first."""
        return list(self._cpu)

    # --------------------------------------------------------------------------- slots
    def acquire(self, digest: str) -> int | None:
        """Make ``digest`` resident in a device slot and take a reference on it.

        Returns:
            The slot, or None when every slot is held by running sequences.

        Raises:
            AdapterError: the adapter cannot be loaded (unknown digest, invalid file).
        """
        slot = self._slot_of.get(digest)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            try:
                self._load(slot, self._get(digest))
            except KeyError:
                self._free_slots.append(slot)
                raise AdapterError(f"unknown adapter {digest}") from None
            except Exception:
                self._free_slots.append(slot)
                raise
            self._slot_of[digest] = slot
            self._resident(digest, True)
        self._slot_of.move_to_end(digest)
        self._refs[slot] += 1
        return slot

    def release(self, digest: str) -> None:
        """Drop one reference (the slot stays resident until evicted)."""
        slot = self._slot_of.get(digest)
        if slot is not None and self._refs[slot] > 0:
            self._refs[slot] -= 1

    def remove(self, digest: str) -> bool:
        """Forget an adapter (hot remove). Refused (False) while a running sequence uses it."""
        slot = self._slot_of.get(digest)
        if slot is not None:
            if self._refs[slot] > 0:
                return False
            del self._slot_of[digest]
            self._resident(digest, False)
            self._clear(slot)
            self._free_slots.append(slot)
        self._cpu.pop(digest, None)
        return True

    def _free_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for digest, slot in self._slot_of.items():  # least recently used first
            if self._refs[slot] == 0:
                del self._slot_of[digest]
                self._resident(digest, False)
                return slot
        return None

    def _resident(self, digest: str, resident: bool) -> None:
        if self.on_residency is not None:
            self.on_residency(digest, resident)

    def _clear(self, slot: int) -> None:
        for buf in self.buffers.values():
            buf.ranks[slot] = 0
            buf.rank_tensor[slot] = 0
            buf.scales[slot] = 0.0
            buf.host_scales[slot] = 0.0
            buf.views[slot] = None

    def _load(self, slot: int, adapter: Any) -> None:
        """Copy an adapter's weights into a slot (zero-padded to ``max_rank``)."""
        if adapter.rank > self.max_rank:
            raise AdapterError(f"adapter rank {adapter.rank} exceeds max_lora_rank {self.max_rank}")
        self._clear(slot)
        for key, (a, b, scale) in adapter.weights.items():
            buf = self.buffers.get(key)
            if buf is None:
                raise AdapterError(f"adapter targets {key}, which this model does not have")
            r = a.shape[0]
            buf.lora_a[slot].zero_()
            buf.lora_b[slot].zero_()
            buf.lora_a[slot, :r].copy_(a)
            buf.lora_b[slot, :, :r].copy_(b)
            buf.scales[slot] = float(scale)
            buf.host_scales[slot] = float(scale)
            buf.ranks[slot] = r
            buf.rank_tensor[slot] = r
            buf.views[slot] = slot_view(buf.lora_a, buf.lora_b, slot, r, float(scale))
        self.num_loads += 1
