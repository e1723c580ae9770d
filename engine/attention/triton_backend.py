"""The Triton attention backend: the paged-attention kernels of :mod:`kernels` behind the engine.

The GPU default; on CPU it runs under the Triton interpreter (``TRITON_INTERPRET=1`` set before
the kernels are imported), which is how the tests check it token for token against ``torch``.
"""

from __future__ import annotations

from loraplex.engine.attention.backend import PagedKernelBackend
from loraplex.kernels.triton_attention import paged_attention
from loraplex.kernels.triton_cache import reshape_and_cache


class TritonAttentionBackend(PagedKernelBackend):
    """Triton kernels over block tables: ``reshape_and_cache`` then ``paged_attention``.

    Decode, prefill and chunked prefill over a cached prefix run in one launch per layer;
    decode-only steps at small batch and long context split the KV (Flash-Decoding) on a GPU.
    On CPU tensors the kernels raise ``RuntimeError`` unless they are interpreted.
    """

    def __init__(self) -> None:
        super().__init__("triton", reshape_and_cache, paged_attention)
