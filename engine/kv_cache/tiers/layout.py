"""What a KV block of the tiers holds: the model, dtype and shape its bytes belong to."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property

import torch

FORMAT_VERSION = 1
"""Version of the tiers' record format (docs/kv_tiers.md); part of every fingerprint."""


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype named as in ``torch`` (``"float32"``, ``"bfloat16"``).

    Raises:
        ValueError: ``dtype`` is not a torch dtype.
    """
    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    return torch.empty((), dtype=found).element_size()


@dataclass(frozen=True)
class KVLayout:
    """The identity and shape of the KV blocks a tier stores; records of two layouts never mix.

    A block's payload is the bytes of a ``[num_layers, 2, block_size, num_kv_heads, head_dim]``
    tensor of ``dtype`` (keys then values per layer), as a contiguous 1-D ``torch.uint8`` CPU
    tensor of ``block_nbytes`` bytes.

    Args:
        model: The model's identity (its name and a digest of its weights): KV of another model
            is never read.
        dtype: The KV cache dtype, a torch dtype name (``"float32"``, ``"bfloat16"``, ...).
        block_size: Tokens per block (> 0).
        num_layers: Decoder layers (> 0).
        num_kv_heads: KV heads per layer (> 0).
        head_dim: Elements per head (> 0).
        hash_scheme: The block-hash scheme whose digests are the keys (e.g. ``"sha256-v1"``).

    Raises:
        ValueError: an empty name, an unknown dtype or a non-positive size.
    """

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_scheme: str

    def __post_init__(self) -> None:
        if not self.model or not self.hash_scheme:
            raise ValueError("KVLayout needs a model identity and a hash scheme")
        dtype_itemsize(self.dtype)
        for field in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{field} must be a positive int, got {value!r}")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, block_size, num_kv_heads, head_dim)``: a block's tensor shape."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @cached_property
    def block_nbytes(self) -> int:
        """Bytes of one block's payload (all layers, keys and values)."""
        n = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return n * dtype_itemsize(self.dtype)

    def to_dict(self) -> dict:
        """The fields, and the format version, as a JSON-ready dict."""
        return {"format_version": FORMAT_VERSION, **asdict(self)}

    def fingerprint(self) -> str:
        """Hex SHA-256 of the canonical JSON of every field and ``FORMAT_VERSION``.

        Returns:
            64 hex characters; any difference in a field gives a different fingerprint.
        """
        return self.fingerprint_digest.hex()

    @cached_property
    def fingerprint_digest(self) -> bytes:
        """The fingerprint's 32 raw bytes (computed once)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).digest()
