"""The attention backend interface and its plain-torch implementation.

A backend does two things per layer and step: write the new K/V into the paged caches through
the slot mapping, then attend each sequence's queries over its whole context through its block
table. There is no contiguous per-request KV anywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from loraplex.engine.attention.metadata import AttentionMetadata
from loraplex.kernels.paged_attention_ref import paged_attention_ref, reshape_and_cache_ref

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    """One attention implementation over block tables (``torch`` or ``triton``)."""

    name: str

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
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write K/V, then attend.

        Args:
            query: ``[T, num_heads, head_dim]``.
            key: ``[T, num_kv_heads, head_dim]`` this step's keys (after RoPE).
            value: ``[T, num_kv_heads, head_dim]``.
            key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` of this layer.
            value_cache: same shape.
            meta: The step's metadata.
            scale: Softmax scale.
            sliding_window: Mistral-style window, None for full attention.
            logits_soft_cap: Gemma 2-style ``cap * tanh(score / cap)``, None for none.
            sinks: gpt-oss-style attention sinks, ``[num_heads]`` softmax logits over no value
                (``kernels.paged_attention_ref``), None for none.

        Returns:
            ``[T, num_heads, head_dim]`` in ``query``'s dtype.

        Raises:
            ValueError: a soft cap or sinks on a backend that cannot apply them.
        """
        ...


class PagedKernelBackend:
    """A backend made of two kernels: write K/V through the slot mapping, then attend.

    Args:
        name: The backend's name (``--attention-backend``).
        write_kv: ``(key, value, key_cache, value_cache, slot_mapping) -> None``, in place.
        attend: ``paged_attention_ref``'s signature: ``(query, key_cache, value_cache,
            block_tables, seq_lens, query_start_loc, scale, *, max_query_len, max_seq_len,
            sliding_window) -> [T, num_heads, head_dim]``.
        supports_soft_cap: Whether ``attend`` takes ``logits_soft_cap``.
        supports_sinks: Whether ``attend`` takes ``sinks``.
        supports_visible_up_to: Whether ``attend`` takes ``visible_up_to`` (queries that see
            past themselves). A step that has them runs the torch reference's attention
            (``kernels.paged_attention_ref``, exact on any device) when ``attend`` does not.
    """

    def __init__(
        self,
        name: str,
        write_kv: Callable[..., None],
        attend: Callable[..., Any],
        *,
        supports_soft_cap: bool = False,
        supports_visible_up_to: bool = False,
        supports_sinks: bool = False,
    ):
        self.name = name
        self._write_kv = write_kv
        self._attend = attend
        self.supports_soft_cap = supports_soft_cap
        self.supports_visible_up_to = supports_visible_up_to
        self.supports_sinks = supports_sinks

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
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`."""
        extra = {}
        attend = self._attend
        if meta.visible_up_to is not None:
            extra["visible_up_to"] = meta.visible_up_to
            if not self.supports_visible_up_to:
                attend = paged_attention_ref
        if logits_soft_cap is not None:
            if not self.supports_soft_cap and attend is not paged_attention_ref:
                raise ValueError(f"the {self.name} attention backend has no logits soft cap")
            extra["logits_soft_cap"] = logits_soft_cap
        if sinks is not None:
            if not self.supports_sinks and attend is not paged_attention_ref:
                raise ValueError(f"the {self.name} attention backend has no attention sinks")
            extra["sinks"] = sinks
        self._write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        return attend(
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
            **extra,
        )


CPU_DECODE_ATTENTION = ("gather", "flex")
"""How the torch backend computes decode-only steps on CPU (``EngineConfig.cpu_decode_attention``):
``gather`` copies each context into a padded batch (``kernels.paged_attention_ref``), ``flex``
reads the paged cache in place through compiled FlexAttention
(``kernels.paged_attention_flex``)."""


class TorchAttentionBackend(PagedKernelBackend):
    """Plain-torch reference backend (the CPU default): ``kernels.paged_attention_ref``.

    Args:
        cpu_decode: One of :data:`CPU_DECODE_ATTENTION`. With ``"flex"``, a step in which
            every sequence has one query (decode-only), on CPU, float32, with no sliding
            window, soft cap, sinks or non-causal queries, runs
            ``kernels.paged_attention_flex``: the block tables become one ``BlockMask`` per
            step (built at the first layer, reused by the rest) and no context is copied.
            Every other step runs the reference. If the compiled kernel fails (no C++
            compiler, say), the backend logs why once and runs the reference from then on.

    Raises:
        ValueError: an unknown ``cpu_decode``.
    """

    def __init__(self, cpu_decode: str = "gather") -> None:
        if cpu_decode not in CPU_DECODE_ATTENTION:
            raise ValueError(
                f"unknown cpu_decode_attention {cpu_decode!r}; expected one of "
                f"{CPU_DECODE_ATTENTION}"
            )
        super().__init__(
            "torch",
            reshape_and_cache_ref,
            paged_attention_ref,
            supports_soft_cap=True,
            supports_visible_up_to=True,
            supports_sinks=True,
        )
        self.cpu_decode = cpu_decode
        self._mask_meta: AttentionMetadata | None = None
        self._mask: Any = None

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
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`; decode-only CPU steps as the class says."""
        if not (
            self.cpu_decode == "flex"
            and sliding_window is None
            and logits_soft_cap is None
            and sinks is None
            and meta.visible_up_to is None
            and meta.max_query_len == 1
            and query.shape[0] == meta.num_seqs
            and query.device.type == "cpu"
            and query.dtype == key_cache.dtype == torch.float32
            and query.shape[1] % key_cache.shape[2] == 0
        ):
            return super().forward(
                query, key, value, key_cache, value_cache, meta, scale,
                sliding_window, logits_soft_cap, sinks,
            )  # fmt: skip
        from loraplex.kernels import paged_attention_flex as flex

        reshape_and_cache_ref(key, value, key_cache, value_cache, meta.slot_mapping)
        try:
            group = query.shape[1] // key_cache.shape[2]
            shape = (key_cache.shape[0], key_cache.shape[1], group)
            built = self._mask and (self._mask.num_blocks, self._mask.block_size, self._mask.group)
            # A new step, or a draft model (other heads, other pool) on the same backend.
            if self._mask_meta is not meta or built != shape:
                self._mask = flex.PagedDecodeMask(
                    meta.block_tables, meta.seq_lens, key_cache.shape[0], key_cache.shape[1],
                    group,
                )  # fmt: skip
                self._mask_meta = meta
            return flex.paged_decode_flex(query, key_cache, value_cache, self._mask, scale)
        except Exception as exc:  # inductor's compile failures come in many kinds
            logger.warning(
                "in-place CPU decode attention (FlexAttention) failed; the gathered "
                "reference runs from now on: %s: %s", type(exc).__name__, exc,
            )  # fmt: skip
            self.cpu_decode = "gather"
            self._mask = self._mask_meta = None
        return paged_attention_ref(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, scale, max_query_len=1, max_seq_len=meta.max_seq_len,
        )  # fmt: skip


def check_backend_runs(backend: AttentionBackend, model: Any, role: str = "model") -> None:
    """Refuse, at load, a model whose attention the backend cannot compute.

    A model states its attention logit soft cap as ``attention_soft_cap`` (Gemma 2's
    ``attn_logit_softcapping``; absent or None for none) and whether its layers have attention
    sinks as ``attention_sinks`` (gpt-oss); a backend without ``supports_soft_cap`` or
    ``supports_sinks`` (the Triton kernel) would fail on the first forward pass instead.

    Args:
        backend: The attention backend.
        model: The loaded model.
        role: What the model is, for the message (``model``, ``speculative model``).

    Raises:
        ValueError: the model needs soft-capping or sinks the backend lacks.
    """
    cap = getattr(model, "attention_soft_cap", None)
    if cap is not None and not getattr(backend, "supports_soft_cap", False):
        raise ValueError(
            f"the {backend.name} attention backend has no attention logit soft-capping, which "
            f"the {role} needs (attn_logit_softcapping={cap}): use --attention-backend torch"
        )
    if getattr(model, "attention_sinks", False) and not getattr(backend, "supports_sinks", False):
        raise ValueError(
            f"the {backend.name} attention backend has no attention sinks, which the {role} "
            "needs: use --attention-backend torch"
        )


def get_attention_backend(name: str, cpu_decode: str = "gather") -> AttentionBackend:
    """The backend called ``name``.

    ``cpu_decode`` is the torch backend's decode path on CPU (:data:`CPU_DECODE_ATTENTION`).

    ``"triton"`` imports the kernels on first use (on CPU, ``TRITON_INTERPRET=1`` must be set
    before that import: the interpreter).

    Raises:
        ValueError: an unknown name, or ``"triton"`` without triton installed (the ``gpu``
            extra).
    """
    if name == "torch":
        return TorchAttentionBackend(cpu_decode)
    if name == "triton":
        try:
            from loraplex.engine.attention.triton_backend import TritonAttentionBackend
        except ModuleNotFoundError as exc:
            if exc.name != "triton":
                raise
            raise ValueError(
                "the triton attention backend needs triton, which the gpu extra installs: "
                'pip install "loraplex[gpu]" (from a checkout: pip install -e ".[gpu]")'
            ) from None
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected 'torch' or 'triton'")
