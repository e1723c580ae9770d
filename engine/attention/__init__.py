"""Attention backends over the paged KV cache: ``torch`` (reference) and ``triton``.

``TritonAttentionBackend`` lives in :mod:`engine.attention.triton_backend`, imported on demand by
:func:`get_attention_backend` so that importing the engine never imports the Triton kernels.
"""

from loraplex.engine.attention.backend import (
    AttentionBackend,
    TorchAttentionBackend,
    check_backend_runs,
    get_attention_backend,
)
from loraplex.engine.attention.metadata import AttentionMetadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "check_backend_runs",
    "get_attention_backend",
]
