"""The attention backend interface and its plain-torch implementation.

A backend does two things per layer and step: write the new K/V into the paged caches through
the slot mapping, then attend each sequence's queries over its whole context through its block
table. There is no contiguous per-request KV anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from loraplex.engine.attention.metadata import AttentionMetadata
from loraplex.kernels.paged_attention_ref import paged_attention_ref, reshape_and_cache_ref


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


class TorchAttentionBackend(PagedKernelBackend):
    """Plain-torch reference backend (the CPU default): ``kernels.paged_attention_ref``."""

    def __init__(self) -> None:
        super().__init__(
            "torch",
            reshape_and_cache_ref,
            paged_attention_ref,
            supports_soft_cap=True,
            supports_visible_up_to=True,
            supports_sinks=True,
        )


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


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend called ``name``.

    ``"triton"`` imports the kernels on first use (on CPU, ``TRITON_INTERPRET=1`` must be set
    before that import: the interpreter).

    Raises:
        ValueError: an unknown name, or ``"triton"`` without triton installed (the ``gpu``
            extra).
    """
    if name == "torch":
        return TorchAttentionBackend()
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
