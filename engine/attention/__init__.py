"""Attention backends over the paged KV cache (``torch`` reference now, ``triton`` later)."""

from engine.attention.backend import AttentionBackend, TorchAttentionBackend, get_attention_backend
from engine.attention.metadata import AttentionMetadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "get_attention_backend",
]
