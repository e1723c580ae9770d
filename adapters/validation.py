"""Validate a PEFT LoRA adapter against the served base model and load it as a :class:`LoraAdapter`.

Two entry points share one pipeline: :func:`load_adapter_files` for an upload (the bytes of
``adapter_config.json`` and ``adapter_model.safetensors``) and :func:`load_adapter_dir` for a
directory. Order of checks, cheapest first, nothing materialized before the header is trusted:

1. ``adapter_config.json`` through PEFT's ``LoraConfig`` (:mod:`adapters.peft_config`).
2. The weights file's size and its header's size and member count against what a valid
   adapter for the served model can reach (:mod:`adapters.sizes`), then the header: dtypes,
   shapes, offsets (:mod:`adapters.safetensors_io`).
3. Tensor names -> ``(layer, target name)`` (the served model's ``nn.Linear`` modules of its
   decoder layers, :class:`adapters.base_model.ModelTargets`); the config's targets resolved as
   PEFT does (:mod:`adapters.targets`); the two sets must be equal, every layer in range.
4. Shapes: ``A [r, in]``, ``B [out, r]`` with the module's configured ``r`` and the served
   model's shape of that module in that layer.
5. Tensors loaded with safetensors, converted to float32, checked finite.

``base_model_name_or_path`` is recorded, never a reason to refuse: hub ids and local paths of the
same weights rarely agree, and the shapes already prove the adapter fits. ``base_model_match``
says whether it names the served model (None when either side names nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.adapters.base_model import BaseModelInfo
from loraplex.adapters.errors import AdapterError
from loraplex.adapters.limits import AdapterLimits
from loraplex.adapters.peft_config import parse_lora_config
from loraplex.adapters.safetensors_io import PICKLE_SUFFIXES, load_tensors, read_header
from loraplex.adapters.sizes import (
    MAX_METADATA_ENTRIES,
    max_header_bytes,
    max_header_tensors,
    max_weights_bytes,
)
from loraplex.adapters.targets import ModuleKey, TargetSpec, map_tensor_names, resolve_targets

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
DIGEST_VERSION = b"loraplex-lora-v1"


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A validated LoRA adapter, ready for the LoRA manager.

    Attributes:
        digest: Hex SHA-256 of what the adapter computes (see :func:`adapter_digest`).
        rank: The largest rank over its modules.
        lora_alpha: The config's ``lora_alpha`` (``alpha_pattern`` may override per module).
        target_modules: Sorted target names it adapts, e.g. ``("q_proj", "v_proj")`` (the
            served model's names: ``qkv_proj`` on Phi-3).
        base_model: ``base_model_name_or_path`` as written (None if empty).
        base_model_match: Whether ``base_model`` names the served model; None if unknown.
        use_rslora: Whether scales are ``alpha / sqrt(r)``.
        weights: ``(layer_idx, target name) -> (A [r, in], B [out, r], scale)``, float32 CPU,
            applied as ``y += scale * (x @ A.T) @ B.T``; the keys are the engine model's
            ``lora_targets()`` keys.
        num_bytes: Bytes of the float32 tensors in ``weights``.
    """

    digest: str
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None
    base_model_match: bool | None
    use_rslora: bool
    weights: dict[ModuleKey, tuple[torch.Tensor, torch.Tensor, float]] = field(repr=False)
    num_bytes: int


def load_adapter_files(
    config_bytes: bytes,
    weights_bytes: bytes,
    *,
    limits: AdapterLimits,
    info: BaseModelInfo | None = None,
) -> LoraAdapter:
    """Validate an uploaded adapter and load its weights.

    Args:
        config_bytes: ``adapter_config.json``.
        weights_bytes: ``adapter_model.safetensors``.
        limits: The served model's targets (names, per-layer shapes, decoder-layer prefix,
            other modules: :func:`adapters.base_model.model_targets`) and largest rank.
        info: The served model's names, to compare ``base_model_name_or_path`` with.

    Returns:
        The adapter.

    Raises:
        AdapterError: anything wrong, with a message naming it (see the module docstring).
    """
    info = info or BaseModelInfo()
    targets, max_rank = limits.targets, limits.max_rank
    num_layers = targets.num_layers
    config = parse_lora_config(config_bytes, max_rank=max_rank)
    largest = max_weights_bytes(targets, max_rank)
    if len(weights_bytes) > largest:
        raise AdapterError(
            f"adapter_model.safetensors is {len(weights_bytes)} bytes; the largest valid adapter "
            f"for the served model (rank {max_rank}, float32) is {largest}"
        )
    entries = read_header(
        weights_bytes,
        max_header_bytes=max_header_bytes(targets),
        max_tensors=max_header_tensors(targets),
        max_metadata=MAX_METADATA_ENTRIES,
    )
    layout, found = map_tensor_names(entries, targets)
    for layer, _ in sorted(found):
        if layer >= num_layers:
            raise AdapterError(
                f"adapter has weights for layer {layer}, the served model has {num_layers} layers"
            )
    specs = resolve_targets(config, layout, targets)
    _check_same_modules(specs, found)
    shapes = targets.shapes()
    for key, spec in specs.items():
        _check_shapes(key, spec, found[key], entries, shapes[key])
    names = [name for key in sorted(found) for name in (found[key]["lora_A"], found[key]["lora_B"])]
    tensors = load_tensors(weights_bytes, names)
    weights = {}
    for key in sorted(specs):
        a, b = (_float32(tensors[found[key][ab]]) for ab in ("lora_A", "lora_B"))
        weights[key] = (a, b, specs[key].scale)
    digest = adapter_digest(specs, found, entries, weights_bytes, config.use_rslora)
    base_model = config.base_model_name_or_path or None
    return LoraAdapter(
        digest=digest,
        rank=max(spec.rank for spec in specs.values()),
        lora_alpha=config.lora_alpha,
        target_modules=tuple(sorted({key[1] for key in specs})),
        base_model=base_model,
        base_model_match=_base_model_match(base_model, info.names),
        use_rslora=bool(config.use_rslora),
        weights=weights,
        num_bytes=sum(a.nbytes + b.nbytes for a, b, _ in weights.values()),
    )


def read_adapter_dir(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """Read ``(config_bytes, weights_bytes)`` from a PEFT adapter directory.

    Raises:
        AdapterError: not a directory; ``adapter_config.json`` missing; weights missing, or
            present only as a pickle file (``adapter_model.bin`` and the like; never read).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"adapter directory {directory} does not exist")
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    if not config_path.is_file():
        raise AdapterError(f"adapter directory {directory} has no {CONFIG_NAME}")
    if not weights_path.is_file():
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise AdapterError(
                f"adapter weights {pickles[0]} are a pickle file; only {WEIGHTS_NAME} is "
                "accepted (save with safe_serialization=True)"
            )
        raise AdapterError(f"adapter directory {directory} has no {WEIGHTS_NAME}")
    return config_path.read_bytes(), weights_path.read_bytes()


def load_adapter_dir(
    path: str | os.PathLike[str],
    *,
    limits: AdapterLimits,
    info: BaseModelInfo | None = None,
) -> LoraAdapter:
    """Validate a PEFT adapter directory and load it (see :func:`load_adapter_files`).

    Raises:
        AdapterError: see :func:`read_adapter_dir` and :func:`load_adapter_files`.
    """
    config_bytes, weights_bytes = read_adapter_dir(path)
    return load_adapter_files(config_bytes, weights_bytes, limits=limits, info=info)


def adapter_digest(
    specs: dict[ModuleKey, TargetSpec],
    found: dict[ModuleKey, dict[str, str]],
    entries: dict,
    data: bytes,
    use_rslora: bool,
) -> str:
    """SHA-256 over what the adapter computes, independent of file bytes and tensor naming.

    Hashed, each chunk prefixed by its length as 8 bytes little-endian:
    ``b"loraplex-lora-v1"``; canonical JSON (sorted keys, no spaces) of
    ``{"use_rslora": bool, "modules": [[layer, name, rank, alpha, scale], ...]}`` sorted
    by ``(layer, name)`` (``name`` the target's, ``q_proj``); then per tensor, sorted by
    canonical name ``"<layer>.<name>.lora_A|lora_B"``: JSON ``[name, dtype, shape]`` and the
    tensor's raw little-endian bytes as stored. File order, header padding, metadata, layout
    prefixes and the config's spelling of targets (list vs regex) do not change it; any weight,
    dtype, rank, alpha or target does.
    """
    h = hashlib.sha256()

    def chunk(payload: bytes | memoryview) -> None:
        h.update(struct.pack("<Q", len(payload)))
        h.update(payload)

    def canonical(obj: object) -> bytes:
        return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()

    chunk(DIGEST_VERSION)
    modules = [[k[0], k[1], s.rank, s.alpha, s.scale] for k, s in sorted(specs.items())]
    chunk(canonical({"use_rslora": bool(use_rslora), "modules": modules}))
    view = memoryview(data)
    for key in sorted(found):
        for ab in ("lora_A", "lora_B"):
            entry = entries[found[key][ab]]
            chunk(canonical([f"{key[0]}.{key[1]}.{ab}", entry.dtype, list(entry.shape)]))
            chunk(view[entry.begin : entry.end])
    return h.hexdigest()


def _check_same_modules(specs: dict[ModuleKey, TargetSpec], found: dict) -> None:
    """The config's targets and the file's tensors must name the same modules, A and B each."""
    missing = sorted(set(specs) - set(found))
    if missing:
        raise AdapterError(f"adapter has no weights for targeted module {specs[missing[0]].module}")
    extra = sorted(set(found) - set(specs))
    if extra:
        layer, name = extra[0]
        raise AdapterError(
            f"adapter has weights for layer {layer} {name}, which its config does not target"
        )
    for key, spec in specs.items():
        for ab in ("lora_A", "lora_B"):
            if ab not in found[key]:
                raise AdapterError(f"adapter is missing {ab} for {spec.module}")


def _check_shapes(key, spec: TargetSpec, names: dict, entries: dict, shape: tuple) -> None:
    """``A [r, in]`` and ``B [out, r]`` with the module's configured rank."""
    in_features, out_features = shape
    expected = {"lora_A": (spec.rank, in_features), "lora_B": (out_features, spec.rank)}
    for ab, want in expected.items():
        got = entries[names[ab]].shape
        if got != want:
            raise AdapterError(
                f"tensor {names[ab]} has shape {list(got)}, expected {list(want)} "
                f"(rank {spec.rank}, {key[1]} is {in_features} -> {out_features} here)"
            )


def _float32(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 CPU copy; refuses NaN and infinity."""
    out = tensor.to(torch.float32).contiguous()
    if not bool(torch.isfinite(out).all()):
        raise AdapterError("adapter weights contain NaN or infinite values")
    return out


def _base_model_match(base_model: str | None, names: tuple[str, ...]) -> bool | None:
    """Whether ``base_model`` equals a served name or a served directory's basename."""
    if not base_model or not names:
        return None

    def forms(name: str) -> set[str]:
        stripped = name.rstrip("/\\")
        return {name, stripped, os.path.basename(stripped)}

    served = set().union(*(forms(n) for n in names if n))
    return bool(forms(base_model) & served)
