"""The interface of a KV tier below the paged pool, and its counters."""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch


@dataclass
class TierStats:
    """Counters of one tier since it was opened (updated under the tier's lock).

    Attributes:
        hits: ``get`` calls that returned a block.
        misses: ``get`` calls that returned None (absent, corrupt, or the store failing).
        stores: blocks written.
        evictions: blocks removed to stay within ``capacity_bytes``.
        corrupt: records found corrupt or truncated on read (each deleted, never served).
        errors: calls the backing store failed (I/O errors, a remote store down or slow).
        rejected: ``put`` calls refused without an error (a record larger than the capacity).
        bytes_read: payload bytes returned by ``get``.
        bytes_written: bytes written (records for disk and remote, payloads for host).
        read_seconds: wall time in ``get`` / ``get_many`` (s).
        write_seconds: wall time in ``put`` (s).
    """

    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    rejected: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0

    def as_dict(self) -> dict:
        """The counters as a plain dict."""
        return asdict(self)


class KVTier(abc.ABC):
    """A byte-bounded store of KV block payloads keyed by block hash (host memory, disk, remote).

    Keys are the engine's block hashes (``bytes``), which already carry the tenant's cache salt,
    the LoRA adapter and image keys: two keys that differ are two records, whatever their
    payloads. Payloads are contiguous 1-D ``torch.uint8`` CPU tensors (``KVLayout.block_nbytes``
    bytes). A returned tensor may be the tier's own buffer: callers read it (copy it into the
    pool) and never write to it. Every method is thread-safe and none raises because the backing
    store failed: failures are counted in ``stats.errors`` and read as a miss / not stored.

    Attributes:
        name: The tier's name in stats and metrics (``"host"``, ``"disk"``, ``"remote"``).
        capacity_bytes: The bound on ``used_bytes``.
        local: True when ``contains`` is an in-process index lookup (no I/O).
        stats: The tier's counters.
    """

    name: str
    capacity_bytes: int
    local: bool = True

    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = int(capacity_bytes)
        self.stats = TierStats()
        self._lock = threading.Lock()

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes held now (<= ``capacity_bytes``)."""

    @abc.abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether a record of ``key`` is held (does not refresh its recency)."""

    @abc.abstractmethod
    def get(self, key: bytes) -> torch.Tensor | None:
        """The payload of ``key``, or None; a hit refreshes the record's recency.

        A corrupt or truncated record is deleted, counted in ``stats.corrupt`` and read as a
        miss: it is never served.
        """

    @abc.abstractmethod
    def put(self, key: bytes, payload: torch.Tensor) -> bool:
        """Store ``payload`` under ``key``, evicting least recently used records to make room.

        A key already held is refreshed, not rewritten (a key names its content).

        Returns:
            True when the block is held afterwards; False when not stored (larger than the
            capacity, the store failing).

        Raises:
            ValueError: ``payload`` is not a block payload (a caller's bug, not a store failure).
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the tier's resources (files, connections); idempotent."""

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` of each key (a remote tier answers in one round trip)."""
        return [self.contains(k) for k in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """``get`` of each key (a remote tier answers in one round trip)."""
        return [self.get(k) for k in keys]

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for field, delta in deltas.items():
                setattr(self.stats, field, getattr(self.stats, field) + delta)

    def snapshot(self) -> dict:
        """A consistent copy of ``stats`` plus ``used_bytes``, ``capacity_bytes`` and ``blocks``."""
        used, blocks = self._usage()
        with self._lock:
            counters = self.stats.as_dict()
        return {
            **counters,
            "used_bytes": used,
            "capacity_bytes": self.capacity_bytes,
            "blocks": blocks,
        }

    def _usage(self) -> tuple[int, int]:
        """Bytes and records held now (a remote tier may ask its store)."""
        return self.used_bytes, len(self)

    def __len__(self) -> int:
        """Records held now."""
        raise NotImplementedError
