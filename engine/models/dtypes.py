"""``--dtype``: the engine's float types, and ``auto``, the checkpoint's own (as vLLM does)."""

from __future__ import annotations

from typing import Any

import torch

#: The dtypes the engine runs in, by ``EngineConfig.dtype`` name.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _name(value: Any) -> str | None:
    """A config's dtype value (a ``torch.dtype`` or a string such as ``"bfloat16"``) as a name."""
    if value is None:
        return None
    return str(value).removeprefix("torch.")


def checkpoint_dtype(hf_config: Any) -> str:
    """The dtype a checkpoint was saved in, from its transformers config.

    ``config.json``'s ``dtype`` (``torch_dtype`` before transformers 4.56), else its text
    config's (a vision-language model may keep it there). float32, bfloat16 and float16 are
    taken as they are; anything else (float64, a float8 type) or nothing is float32, the type
    every checkpoint's values fit.

    Returns:
        A key of :data:`DTYPES`.
    """
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        if config is None:
            continue
        name = _name(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
        if name is not None:
            return name if name in DTYPES else "float32"
    return "float32"


def resolve_dtype(requested: str, hf_config: Any) -> str:
    """``requested`` (an ``EngineConfig.dtype``), with ``auto`` made :func:`checkpoint_dtype`."""
    return checkpoint_dtype(hf_config) if requested == "auto" else requested
