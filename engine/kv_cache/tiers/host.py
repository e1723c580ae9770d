"""The host-memory tier: payload tensors in an LRU bounded in bytes."""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from loraplex.engine.kv_cache.tiers.base import KVTier
from loraplex.engine.kv_cache.tiers.codec import check_payload


class HostTier(KVTier):
    """Blocks in host memory, least recently used evicted first (as vLLM's CPU offloading).

    ``put`` keeps the tensor it is given (no copy): the caller hands over a tensor it no longer
    writes to. ``get`` returns that tensor and moves the block to the most recent end.

    Args:
        capacity_bytes: Bound on the payload bytes held (>= 0; 0 holds nothing).
        name: The tier's name in stats.
    """

    def __init__(self, capacity_bytes: int, *, name: str = "host") -> None:
        super().__init__(name, capacity_bytes)
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._used = 0

    @property
    def used_bytes(self) -> int:
        """Payload bytes held now."""
        with self._lock:
            return self._used

    def __len__(self) -> int:
        """Blocks held now."""
        with self._lock:
            return len(self._blocks)

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is held (recency unchanged)."""
        with self._lock:
            return key in self._blocks

    def get(self, key: bytes) -> torch.Tensor | None:
        """The held tensor of ``key`` (not a copy: read only) or None; a hit becomes most recent."""
        start = time.perf_counter()
        with self._lock:
            payload = self._blocks.get(key)
            if payload is None:
                self.stats.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_read += payload.numel()
            self.stats.read_seconds += time.perf_counter() - start
            return payload

    def put(self, key: bytes, payload: torch.Tensor) -> bool:
        """Hold ``payload`` (not copied), evicting the least recently used blocks to fit.

        Returns:
            False when the payload alone exceeds ``capacity_bytes``.

        Raises:
            ValueError: ``payload`` is not a contiguous 1-D uint8 CPU tensor.
        """
        check_payload(payload)
        start = time.perf_counter()
        size = payload.numel()
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return True
            if size > self.capacity_bytes:
                self.stats.rejected += 1
                return False
            while self._used + size > self.capacity_bytes:
                _, old = self._blocks.popitem(last=False)
                self._used -= old.numel()
                self.stats.evictions += 1
            self._blocks[key] = payload
            self._used += size
            self.stats.stores += 1
            self.stats.bytes_written += size
            self.stats.write_seconds += time.perf_counter() - start
            return True

    def close(self) -> None:
        """Drop every block."""
        with self._lock:
            self._blocks.clear()
            self._used = 0
