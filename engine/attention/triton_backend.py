"""The Triton attention backend: the paged-attention kernels of :mod:`kernels` behind the engine.

The GPU default; on CPU it runs under the Triton interpreter (``TRITON_INTERPRET=1`` set before
the kernels are imported), which is how the tests check it token for token against ``torch``.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from kernels.triton_attention import paged_attention
from kernels.triton_cache import reshape_and_cache


class TritonAttentionBackend:
    """Triton kernels over block tables: ``reshape_and_cache`` then ``paged_attention``.

    Decode, prefill and chunked prefill over a cached prefix run in one launch per layer;
    decode-only steps at small batch and long context split the KV (Flash-Decoding) on a GPU.
    """

    name = "triton"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """See :meth:`engine.attention.backend.AttentionBackend.forward`.

        Raises:
            RuntimeError: CPU tensors while the kernels are not interpreted.
        """
        reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        return paged_attention(
            query,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            sliding_window=sliding_window,
        )
