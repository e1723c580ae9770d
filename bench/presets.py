"""The benches' random-weight text models, by ``tiny_model`` preset, and their byte counts.

Each model is written once into the data directory (``<data dir>/bench/<name>``) and reused by
every later run:

- ``tiny``: the built-in model (hidden 64, 4 layers), for smoke runs.
- ``bench``: 26.4M parameters (hidden 512, 8 layers), the older CPU workloads.
- ``smollm-135m``: SmolLM-135M's shape (30 layers, GQA 9/3, vocab 49152, tied), 134.5M.
- ``smollm2-135m``: SmolLM2-135M's shape: the same layers with 8192 positions, rope theta 1e5.
- ``llama-1b``: a Llama-3.2-1B-like shape for GPU runs (16 layers, hidden 2048, MLP 8192, GQA
  32/8, head_dim 64, vocab 32000, tied), 1.05B parameters, saved in bfloat16 (2.1 GB; about
  10 s to draw and write on one core, once).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loraplex.gateway.settings import data_dir

PRESETS = ("tiny", "bench", "smollm-135m", "smollm2-135m", "llama-1b")
DIR_NAMES = {  # the names the benches used before this module
    "tiny": "tiny-text",
    "bench": "tiny-text-bench",
    "smollm-135m": "smollm-135m-shape",
    "smollm2-135m": "smollm2-135m-shape",
    "llama-1b": "llama-1b-shape",
}


def preset_dir(preset: str) -> Path:
    """The text model of ``preset`` (see the module docstring), written on first use.

    Raises:
        ValueError: an unknown preset.
    """
    from loraplex.engine.models.tiny_model import init_tiny

    if preset not in DIR_NAMES:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    target = data_dir() / "bench" / DIR_NAMES[preset]
    if not (target / "config.json").exists():
        dtype = torch.bfloat16 if preset == "llama-1b" else torch.float32
        kwargs = {} if preset == "tiny" else {"preset": preset}
        init_tiny(target, seed=0, text_only=True, weights_dtype=dtype, **kwargs)
    return target


def weight_bytes_read(config: dict, dtype_bytes: int, num_parameters: int) -> int:
    """Bytes of weights a decode step reads.

    Every parameter once (a tied embedding once, as the output head), except an untied input
    embedding, of which a step reads only its tokens' rows (counted as none here).

    Args:
        config: The model's ``config.json`` (a Llama-family text config).
        dtype_bytes: Bytes per weight element in the run's dtype.
        num_parameters: Elements of the checkpoint's tensors (a tied embedding once).
    """
    untied = 0 if config.get("tie_word_embeddings", False) else 1
    return (num_parameters - untied * config["vocab_size"] * config["hidden_size"]) * dtype_bytes


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """Bytes of K and V one token of context holds over all layers.

    ``layers x kv_heads x head_dim x 2 (K and V) x dtype_bytes``.
    """
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * dtype_bytes
