"""The paged attention function transformers' own modeling code calls (the backend's hook).

transformers dispatches every attention module's core through ``AttentionInterface`` by the
name in ``config._attn_implementation``. Registering :func:`paged_attention_forward` as
``"loraplex"`` (vLLM's Transformers backend registers ``"vllm"`` the same way) makes the model's
attention layers hand their queries, keys and values (after q/k norms and rotary embedding, in
the model's own code) to the engine's attention backend, which writes K/V into the paged cache
through the step's slot mapping and attends through its block tables. A name that is not in
``AttentionMaskInterface`` also makes transformers skip building masks: causality, sliding
windows, soft-capping and attention sinks are the backend's (docs/transformers_backend.md); a
model whose attention needs more is refused at load (:mod:`.probe`).

The step's caches and metadata reach the function through a context variable set for the
duration of one forward pass (:func:`paged_step`), not through the model's keyword arguments,
which not every architecture forwards to its attention layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from loraplex.engine.attention import AttentionBackend, AttentionMetadata

ATTN_IMPLEMENTATION = "loraplex"
"""The name the paged attention function is registered under in transformers."""


@dataclass(frozen=True)
class PagedStep:
    """What the attention layers of one forward pass need.

    Attributes:
        kv_caches: One ``(key_cache, value_cache)`` per decoder layer, each
            ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        meta: The step's attention metadata.
        backend: The attention backend.
        layer_of: ``id(attention module) -> decoder layer index`` (its KV cache pair).
        calls: The layers that called :func:`paged_attention_forward` so far, in order (the
            model checks that every layer did).
    """

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata
    backend: AttentionBackend
    layer_of: dict[int, int]
    calls: list[int] = field(default_factory=list)


class PagedAttentionBypassed(RuntimeError):
    """A decoder layer's attention did not call :func:`paged_attention_forward` in a step."""


_STEP: ContextVar[PagedStep | None] = ContextVar("loraplex_paged_step", default=None)


@contextmanager
def paged_step(step: PagedStep) -> Iterator[None]:
    """Make ``step`` what :func:`paged_attention_forward` reads during a forward pass."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def current_step() -> PagedStep:
    """The step of the forward pass under way.

    Raises:
        RuntimeError: outside :func:`paged_step`.
    """
    step = _STEP.get()
    if step is None:
        raise RuntimeError("the loraplex attention runs only inside an engine step")
    return step


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature over the engine's paged KV cache.

    Args:
        module: The calling attention module (its layer picks the KV cache pair).
        query: ``[1, num_heads, T, head_dim]``: the step's tokens as one row.
        key: ``[1, num_kv_heads, T, head_dim]`` this step's keys.
        value: ``[1, num_kv_heads, T, head_dim]``.
        attention_mask: Ignored (None: transformers builds none for this implementation).
        scaling: Softmax scale (``head_dim ** -0.5`` when None).
        dropout: Must be 0 (inference).
        sliding_window: The layer's window, None for full attention.
        softcap: The layer's attention logit soft cap, None for none.
        s_aux: The layer's attention sinks (gpt-oss), ``[num_heads]``, None for none.

    Returns:
        ``([1, T, num_heads, head_dim], None)``, as transformers' functions return.

    Raises:
        RuntimeError: called outside an engine step, or by a module of no decoder layer.
    """
    step = current_step()
    layer = step.layer_of.get(id(module))
    if layer is None:
        raise RuntimeError(f"{type(module).__name__} is not a decoder layer's attention")
    if query.shape[0] != 1 or dropout:
        raise RuntimeError("the loraplex attention takes one flattened row, without dropout")
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    step.calls.append(layer)
    key_cache, value_cache = step.kv_caches[layer]
    extra = {} if s_aux is None else {"sinks": s_aux}
    out = step.backend.forward(
        q, k, v, key_cache, value_cache, step.meta, scale,
        sliding_window=sliding_window, logits_soft_cap=softcap, **extra,
    )  # fmt: skip
    return out.unsqueeze(0), None


def register() -> None:
    """Register :func:`paged_attention_forward` as ``"loraplex"`` in transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
