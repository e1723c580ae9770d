"""A load-time check that the paged attention computes what the model's own attention does.

The backend hands every decoder attention layer's queries, keys and values to the engine's
paged attention, which knows causality, sliding windows, logit soft-capping and attention sinks
(``s_aux``), nothing else. An architecture whose attention means more (ALiBi or other biases
passed as the attention mask, differential attention, an attention layer that does not go
through transformers' ``AttentionInterface`` at all) would run and produce wrong tokens
silently.

:func:`check_paged_attention` runs the decoder twice over one probe sequence at load: through
the engine's paged attention (a private one-sequence KV cache), and through transformers'
``eager`` attention with the masks transformers builds for it, and refuses the model when the
final hidden states differ, or when a decoder layer never called the paged attention.
"""

from __future__ import annotations

from typing import Any

import torch

from loraplex.engine.attention import AttentionMetadata, TorchAttentionBackend
from loraplex.engine.models.transformers_backend.attention import (
    ATTN_IMPLEMENTATION,
    PagedAttentionBypassed,
    register,
)

PROBE_TOKENS = 24
"""Length of the probe sequence: past a block, short enough to cost nothing at load."""
_BYPASS = (
    "the transformers backend serves models whose every decoder layer calls transformers' "
    "AttentionInterface once per forward pass"
)
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""Largest ``max |paged - eager| / max |eager|`` accepted, per dtype (half precision: 5e-2)."""


def _probe_metadata(num_tokens: int, device: torch.device) -> AttentionMetadata:
    """One sequence of ``num_tokens`` new tokens in block 0 of a one-block cache."""
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.long, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.zeros((1, 1), dtype=torch.int32, device=device),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )


class _ShapeRecorder:
    """An attention "backend" that records the shapes it is handed and returns zeros."""

    name = "shape probe"
    supports_soft_cap = True

    def __init__(self) -> None:
        self.shapes: set[tuple[int, int, int, int]] = set()

    def forward(self, query, key, value, key_cache, value_cache, meta, scale, **_: Any):
        """Record ``(query heads, KV heads, key head size, value head size)``; zeros out."""
        self.shapes.add((query.shape[1], key.shape[1], key.shape[2], value.shape[2]))
        return query.new_zeros((*query.shape[:2], value.shape[2]))


@torch.inference_mode()
def measure_attention_shapes(model: Any, num_tokens: int = 4) -> tuple[int, int, int]:
    """The query heads, KV heads and head size the decoder's attention layers really pass.

    Read from the layers' calls rather than from config fields, which architectures name
    differently (``num_key_value_heads``, GPT-BigCode's ``multi_query``, a ``head_dim`` the
    config does not state...), so the paged KV cache is sized for the tensors it will hold.

    Args:
        model: A :class:`~.model.TransformersForCausalLM` (before its KV cache exists).
        num_tokens: Probe length.

    Returns:
        ``(num_heads, num_kv_heads, head_dim)``.

    Raises:
        ValueError: layers that differ in these shapes, keys and values of different head
            sizes (one paged cache layout holds every layer), or layers that bypass the paged
            attention.
    """
    recorder = _ShapeRecorder()
    device = model.device
    ids = torch.ones(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    empty = torch.empty(0, device=device)
    caches = [(empty, empty)] * model.num_layers
    name = type(model.hf).__name__
    register()
    config = model.text_config
    implementation = config._attn_implementation
    config._attn_implementation = ATTN_IMPLEMENTATION  # as the loader builds it
    try:
        model.forward(ids, positions, caches, _probe_metadata(num_tokens, device), recorder)
    except PagedAttentionBypassed as exc:
        raise ValueError(f"{name}: {exc}; {_BYPASS}") from exc
    except Exception as exc:  # transformers' own code, run as the backend runs it
        raise ValueError(
            f"{name} cannot run as the transformers backend runs it (the step's tokens as one "
            f"row of positions, no attention mask, no cache): {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        config._attn_implementation = implementation
    if len(recorder.shapes) != 1:
        raise ValueError(
            f"attention layers of different shapes {sorted(recorder.shapes)} (query heads, KV "
            "heads, key and value head sizes) are not supported: one paged KV cache layout "
            "holds every layer"
        )
    ((num_heads, num_kv_heads, key_dim, value_dim),) = recorder.shapes
    if key_dim != value_dim:
        raise ValueError(f"keys of head size {key_dim} and values of {value_dim} are not supported")
    return num_heads, num_kv_heads, key_dim


@torch.inference_mode()
def check_paged_attention(model: Any, num_tokens: int = PROBE_TOKENS) -> None:
    """Refuse a model whose attention the paged attention does not reproduce.

    Args:
        model: A :class:`~.model.TransformersForCausalLM`.
        num_tokens: Probe length (token ids ``1 .. num_tokens`` of the vocabulary, positions
            ``0 .. num_tokens - 1``).

    Raises:
        ValueError: a decoder layer whose attention never reached the paged attention, or
            final hidden states that differ from transformers' eager attention by more than
            :data:`TOLERANCE`.
    """
    device = model.device
    num_tokens = min(num_tokens, model.max_position_embeddings, model.vocab_size - 1)
    ids = torch.arange(1, num_tokens + 1, device=device)
    positions = torch.arange(num_tokens, device=device)
    shape = (1, num_tokens, model.num_kv_heads, model.head_dim)
    caches = [
        (torch.zeros(shape, dtype=model.dtype, device=device),
         torch.zeros(shape, dtype=model.dtype, device=device))
        for _ in range(model.num_layers)
    ]  # fmt: skip
    meta = _probe_metadata(num_tokens, device)
    name = type(model.hf).__name__
    try:
        paged = model.forward(ids, positions, caches, meta, TorchAttentionBackend())
    except PagedAttentionBypassed as exc:
        raise ValueError(f"{name}: {exc}; {_BYPASS}") from exc
    config = model.text_config
    implementation = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        eager = model.forward(ids, positions, caches, meta, TorchAttentionBackend())
    except Exception as exc:  # transformers' own code: any error means it cannot be checked
        raise ValueError(
            f"{name}: transformers' eager attention fails on a {num_tokens}-token probe, so the "
            f"paged attention cannot be checked against it: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        config._attn_implementation = implementation
    scale = eager.float().abs().max().clamp_min(1e-6)
    error = ((paged.float() - eager.float()).abs().max() / scale).item()
    tolerance = TOLERANCE.get(model.dtype, 5e-2)
    if not error <= tolerance:
        raise ValueError(
            f"{name}: the engine's paged attention does not reproduce the model's own attention "
            f"(relative difference {error:.2g} over a {num_tokens}-token probe, tolerance "
            f"{tolerance:g}): its attention uses something besides causal or sliding-window "
            "softmax attention with soft-capping and sinks (an attention bias such as ALiBi, "
            "...), which the transformers backend does not support"
        )
