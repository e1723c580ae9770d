"""How large a valid adapter for the served model can be, from the model's shapes alone.

An adapter holds at most, for each target ``t`` of each decoder layer (an ``nn.Linear`` of
``in_t`` inputs and ``out_t`` outputs, :class:`adapters.base_model.ModelTargets`), an
``A [r, in_t]`` and a ``B [out_t, r]`` with ``r <= max_rank``, each at most 4 bytes an element
(F32). So its ``adapter_model.safetensors`` weighs at most::

    8 + max_header_bytes + sum_t(max_rank * (in_t + out_t) * 4)

and its header names at most ``2 * (targets over all layers)`` tensors plus ``__metadata__``.
Headers are allowed :data:`HEADER_TENSORS_SLACK` more tensors than that, so an adapter made for
the whole model (a LLaVA ``all-linear`` adapter that also adapts the vision tower) is refused by
name, pointing at the modules that cannot carry LoRA here.

Uploads are capped by these figures before anything is parsed or inflated
(archives, multipart parts, the safetensors header), so no upload can make the server hold more
than the largest adapter it could serve.
"""

from __future__ import annotations

from loraplex.adapters.base_model import ModelTargets

HEADER_BYTES_PER_TENSOR = 512
"""Header budget per tensor: its name (~100 bytes for the longest PEFT layout) and
``{"dtype", "shape", "data_offsets"}`` (~80 bytes), with room to spare."""
HEADER_BASE_BYTES = 64 * 1024
"""Header budget for ``__metadata__``, the braces and the padding writers add."""
MAX_METADATA_ENTRIES = 64
"""Most ``__metadata__`` entries (PEFT writes one: ``{"format": "pt"}``)."""
MAX_DTYPE_BYTES = 4
"""The widest accepted dtype (F32)."""
HEADER_TENSORS_SLACK = 1024
"""Tensors a header may name beyond the decoder's (a vision tower's: CLIP-L has 288)."""


def max_tensors(targets: ModelTargets) -> int:
    """Most tensors a valid adapter holds: ``lora_A`` and ``lora_B`` per target and layer."""
    return 2 * targets.num_targets()


def max_header_tensors(targets: ModelTargets) -> int:
    """Most tensors a header may name before it is refused unparsed (with the slack)."""
    return max_tensors(targets) + HEADER_TENSORS_SLACK


def max_header_bytes(targets: ModelTargets) -> int:
    """Most bytes of a safetensors header (:func:`max_header_tensors` entries)."""
    return HEADER_BASE_BYTES + HEADER_BYTES_PER_TENSOR * max_header_tensors(targets)


def max_weights_bytes(targets: ModelTargets, max_rank: int) -> int:
    """Most bytes of a valid ``adapter_model.safetensors`` (see the module docstring).

    Args:
        targets: The served model's targets and their shapes.
        max_rank: The largest rank served.
    """
    weights = max_rank * targets.total_features() * MAX_DTYPE_BYTES
    return 8 + max_header_bytes(targets) + weights
