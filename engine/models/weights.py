"""Finding and reading a checkpoint's safetensors files (never pickle)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint in ``model_dir`` to the file holding it.

    Looks for, in order: ``model.safetensors.index.json`` (sharded), ``model.safetensors``,
    any other ``*.safetensors``.

    Raises:
        ValueError: only pickle weights (``.bin``/``.pt``), a bad index, or a tensor in two
            files.
        FileNotFoundError: no weights at all, or a shard the index names is missing.
    """
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"bad safetensors index {index_path}: {exc}") from exc
        files = {}
        for name, shard in weight_map.items():
            path = model_dir / shard
            if not path.is_file():
                raise FileNotFoundError(f"shard {shard!r} named by {index_path} is missing")
            files[name] = path
        # The index is what Hugging Face trusts; still check it matches the shards' contents.
        for path in sorted(set(files.values())):
            for name in _keys(path):
                if files.get(name) != path:
                    raise ValueError(f"tensor {name!r} in {path} is not in {index_path}")
        return files
    candidates = [model_dir / SINGLE_FILE] if (model_dir / SINGLE_FILE).is_file() else []
    candidates = candidates or sorted(model_dir.glob("*.safetensors"))
    if not candidates:
        pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(
                f"{model_dir} has only pickle weights ({', '.join(pickles)}); loraplex loads "
                "safetensors only: convert them (save_pretrained(safe_serialization=True))"
            )
        raise FileNotFoundError(f"no model weights (*.safetensors) in {model_dir}")
    files: dict[str, Path] = {}
    for path in candidates:
        for name in _keys(path):
            if name in files:
                raise ValueError(f"tensor {name!r} is in both {files[name]} and {path}")
            files[name] = path
    return files


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"unreadable safetensors file {path}: {exc}") from exc


def read_tensors(
    files: dict[str, Path], names: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the tensors ``names`` maps (checkpoint name -> engine name), one file at a time.

    Args:
        files: From :func:`weight_files`.
        names: Checkpoint tensor name to the name it is yielded under.

    Yields:
        ``(engine_name, tensor)`` on CPU, in the checkpoint's dtype.
    """
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for path, file_names in sorted(by_file.items()):
        with safe_open(path, framework="pt") as f:
            for name in file_names:
                yield names[name], f.get_tensor(name)
