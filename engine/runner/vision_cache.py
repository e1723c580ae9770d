"""The vision encoder cache: image encodings kept by (cache salt, image key), LRU.

A request whose KV blocks miss but whose image was encoded before (within the same salt, i.e.
the same tenant) skips the vision tower and the projector.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class VisionCache:
    """LRU map ``(cache_salt, image_key) -> [num_image_tokens, hidden]`` features.

    Args:
        capacity: Most entries kept (0 disables the cache).

    Raises:
        ValueError: a negative capacity.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str | None, str], torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, salt: str | None, key: str) -> torch.Tensor | None:
        """The cached features, or None; a hit becomes the most recently used entry."""
        features = self._entries.get((salt, key))
        if features is None:
            self.misses += 1
            return None
        self._entries.move_to_end((salt, key))
        self.hits += 1
        return features

    def put(self, salt: str | None, key: str, features: torch.Tensor) -> None:
        """Store features, evicting the least recently used entries beyond capacity."""
        if self.capacity == 0:
            return
        self._entries[(salt, key)] = features
        self._entries.move_to_end((salt, key))
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
