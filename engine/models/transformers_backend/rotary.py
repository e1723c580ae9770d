"""Length-dependent rotary embeddings, computed one sequence at a time.

Two of transformers' rope types choose their frequencies from the length of the sequence in
the forward pass (``modeling_rope_utils.dynamic_rope_update``, read as ``max(position_ids) + 1``):
``longrope`` (Phi-3 128k, Phi-3.5, Phi-4-mini: the long factors past
``original_max_position_embeddings``, the short ones below) and the ``dynamic`` types (dynamic
NTK: frequencies rescaled for the length, and state kept in the module between calls). The
engine's forward pass is one row of every scheduled sequence's tokens, so called as is the
module would take one length for the whole batch: a short request's tokens would get the long
factors whenever a long one shares its step, and its output would depend on its neighbours.

:class:`PerSequenceRotary` wraps such a module and calls it once per sequence of the step
(``query_start_loc`` of the step's metadata), each time from the state the module had when the
model was loaded, so each sequence's frequencies come from its own positions only, as in
transformers' ``generate`` for that sequence alone. Rope types whose frequencies do not depend
on the length (default, linear, yarn, llama3...) are left alone: one call serves the batch.

What stays different from transformers (docs/transformers_text_archs.md): a prompt longer than
the switch-over length whose first chunks are prefilled before it reaches that length (chunked
prefill) or that reuses prefix-cache blocks computed for a shorter sequence gets, for those
positions, the frequencies of the length at the time they were computed; transformers computes
a whole prompt with the frequencies of its full length.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loraplex.engine.models.transformers_backend.attention import current_step

_STATE_SUFFIXES = ("max_seq_len_cached", "attention_scaling")


def is_length_dependent(rope_type: Any) -> bool:
    """Whether a ``rope_type`` changes its frequencies with the sequence length.

    ``rope_type`` is a rotary module's: a name, or a dict of names per layer type (Gemma 3).
    Length-dependent: ``dynamic*`` and ``longrope``.
    """
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in types)


class PerSequenceRotary(nn.Module):
    """Calls a length-dependent rotary module once per sequence of the engine step.

    Args:
        inner: A transformers rotary embedding module (``forward(x, position_ids, ...)`` returning
            ``(cos, sin)``, each ``[..., 1, T, rotary_dim]``), in its state as loaded.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self._saved_buffers = list(dict(inner.named_buffers(recurse=False)))
        for name in self._saved_buffers:
            self.register_buffer(f"saved_{name}", getattr(inner, name).clone(), persistent=False)
        self._saved_attrs = {
            k: v for k, v in vars(inner).items() if k.endswith(_STATE_SUFFIXES) and k[0] != "_"
        }

    def _restore(self) -> None:
        """Put the wrapped module back in its as-loaded state (frequencies, cached length)."""
        for name in self._saved_buffers:
            saved = getattr(self, f"saved_{name}")
            self.inner.register_buffer(name, saved.clone(), persistent=False)
        for key, value in self._saved_attrs.items():
            setattr(self.inner, key, value)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of the step's ``[1, T]`` positions, each sequence's from its own length.

        Args:
            x: ``[1, T, hidden]`` (its dtype and device are what the module reads).
            position_ids: ``[..., 1, T]`` positions, the step's sequences one after another.
            args: Passed on (Gemma 3's ``layer_type``).
            kwargs: Passed on.

        Returns:
            The module's ``(cos, sin)`` for all ``T`` tokens, in step order.

        Raises:
            RuntimeError: called outside an engine step.
        """
        bounds = current_step().meta.query_start_loc.tolist()
        parts = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            self._restore()
            positions = position_ids[..., start:end]  # [1, n], or M-RoPE's [3, 1, n]
            parts.append(self.inner(x[:, start:end], positions, *args, **kwargs))
        self._restore()
        return torch.cat([c for c, _ in parts], dim=-2), torch.cat([s for _, s in parts], dim=-2)


def wrap_length_dependent_rotary(root: nn.Module) -> int:
    """Wrap every length-dependent rotary module under ``root`` in a :class:`PerSequenceRotary`.

    Returns:
        How many modules were wrapped.
    """
    targets = [
        (name, module)
        for name, module in root.named_modules()
        if not isinstance(module, PerSequenceRotary)
        and type(module).__name__.endswith("RotaryEmbedding")
        and is_length_dependent(getattr(module, "rope_type", None))
    ]
    for name, module in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, leaf, PerSequenceRotary(module))
    return len(targets)
