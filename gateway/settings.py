"""Where loraplex keeps its files, and the built-in model's location."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DATA_DIR = ".loraplex"
TINY_MODEL_SUBDIR = "models/tiny-llava"


def data_dir(explicit: str | None = None) -> Path:
    """The data directory: ``--data-dir``, else ``$LORAPLEX_DATA_DIR``, else ``./.loraplex``."""
    return Path(explicit or os.environ.get("LORAPLEX_DATA_DIR") or DEFAULT_DATA_DIR)


def resolve_model(model: str | None, data: Path) -> str:
    """The model directory to serve: ``--model``, or the built-in tiny LLaVA.

    The built-in model is written into ``DATA/models/tiny-llava`` on first use (seed 0).
    """
    if model:
        return model
    target = data / TINY_MODEL_SUBDIR
    if not (target / "config.json").exists():
        from engine.tiny_model import init_tiny

        init_tiny(target, seed=0)
    return str(target)
