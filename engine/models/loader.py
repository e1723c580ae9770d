"""Load a Hugging Face model directory into an engine model (safetensors only).

Checkpoint tensor names are mapped onto the engine's own names, which follow Hugging Face's
text layout (``model.layers.N...``, ``lm_head``) and, for LLaVA, the legacy layout::

    checkpoint name (any of these)                 engine name
    model.language_model.X       (transformers 4.52+)  language_model.model.X
    language_model.model.X       (legacy llava-hf)     language_model.model.X
    lm_head.X / language_model.lm_head.X               language_model.lm_head.X
    model.vision_tower.[vision_model.]X                vision_tower.X
    vision_tower.[vision_model.]X                      vision_tower.X
    model.multi_modal_projector.X / multi_modal_projector.X

The fused projections (``self_attn.qkv_proj``, ``mlp.gate_up_proj``: ``engine.models.fused``)
are not in checkpoints: each of their parameters is assembled from the separate tensors whose
rows it stacks (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``), each copied into
its row range, so the plan below works in the checkpoint's (separate) names throughout.

Every engine parameter must come from the checkpoint and every checkpoint tensor must be used,
except those the engine deliberately skips (rotary ``inv_freq`` buffers, CLIP's
``post_layernorm`` and ``position_ids``, vision layers past the deepest feature layer, a tied
``lm_head``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loraplex.engine.models.fused import stacked_params
from loraplex.engine.models.registry import build_model, is_multimodal, resolve_model_impl
from loraplex.engine.models.weights import read_tensors, weight_files

_LLAVA_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_IGNORED = (
    re.compile(r"(^|\.)rotary_emb\.inv_freq$"),
    re.compile(r"^vision_tower\.post_layernorm\.(weight|bias)$"),
    re.compile(r"^vision_tower\.embeddings\.position_ids$"),
)
_VISION_LAYER = re.compile(r"^vision_tower\.encoder\.layers\.(\d+)\.")
_LIST_LIMIT = 12


def engine_name(checkpoint_name: str, multimodal: bool) -> str:
    """The engine parameter name a checkpoint tensor name maps to (see the module docstring)."""
    name = checkpoint_name
    if not multimodal:
        return name
    for old, new in _LLAVA_PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    if name.startswith("vision_tower.vision_model."):
        name = "vision_tower." + name[len("vision_tower.vision_model.") :]
    return name


def load_config(model_dir: str | Path) -> Any:
    """``AutoConfig.from_pretrained(model_dir)`` with clear errors.

    Raises:
        FileNotFoundError: a missing directory or ``config.json``.
        ValueError: a path that is not a directory, or a config transformers cannot read.
    """
    path = Path(model_dir)
    if not path.exists():
        raise FileNotFoundError(f"model directory not found: {path}")
    if not path.is_dir():
        raise ValueError(f"model path is not a directory: {path}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many types for a bad config
        raise ValueError(f"cannot read {path / 'config.json'}: {exc}") from exc


def _listing(names: set[str] | list[str]) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else ""
    return ", ".join(names[:_LIST_LIMIT]) + more


def separate_shapes(model: nn.Module) -> dict[str, tuple[torch.Size, str | None, int]]:
    """Every tensor a checkpoint must provide, by the name the engine reads it under.

    Args:
        model: The engine model (on the meta device is enough).

    Returns:
        ``name -> (shape, fused, start)``: a parameter of the model's ``state_dict`` maps to
        itself (``fused`` None); a slice of a fused parameter (``...self_attn.k_proj.weight``)
        to its own shape, the fused parameter it fills and its first row there.
    """
    state = model.state_dict()
    stacked = stacked_params(model)
    out: dict[str, tuple[torch.Size, str | None, int]] = {}
    for name, tensor in state.items():
        slices = stacked.get(name)
        if slices is None:
            out[name] = (tensor.shape, None, 0)
            continue
        for part, start, end in slices:
            out[part] = (torch.Size((end - start, *tensor.shape[1:])), name, start)
    return out


def _plan(
    model: nn.Module, checkpoint_names: list[str], multimodal: bool, model_dir: Path
) -> dict[str, str]:
    """Map checkpoint names to engine names; raise on missing or unexpected tensors."""
    expected = set(separate_shapes(model))
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    lm_head = "language_model.lm_head.weight" if multimodal else "lm_head.weight"
    if tied:
        expected.discard(lm_head)
    vision_layers = model.vision_config.num_layers_run if multimodal else 0
    plan: dict[str, str] = {}
    unexpected = []
    for ckpt in checkpoint_names:
        name = engine_name(ckpt, multimodal)
        if name in expected:
            if name in plan.values():
                raise ValueError(f"{model_dir}: two checkpoint tensors map to {name!r}")
            plan[ckpt] = name
            continue
        layer = _VISION_LAYER.match(name)
        skip = (tied and name == lm_head) or any(p.search(name) for p in _IGNORED)
        if not skip and not (layer and int(layer.group(1)) >= vision_layers):
            unexpected.append(ckpt)
    missing = expected - set(plan.values())
    if missing:
        raise ValueError(f"{model_dir}: checkpoint is missing tensors: {_listing(missing)}")
    if unexpected:
        raise ValueError(f"{model_dir}: unexpected tensors in checkpoint: {_listing(unexpected)}")
    return plan


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    model_impl: str = "auto",
) -> tuple[nn.Module, Any]:
    """Build the engine model for a Hugging Face directory and load its weights.

    ``model_impl`` picks the implementation (``engine.models.registry.resolve_model_impl``):
    the native model below, or transformers' own code over the paged KV cache
    (``engine.models.transformers_backend``).

    Args:
        model_dir: Directory with ``config.json`` and ``model.safetensors`` (or sharded
            ``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``).
        dtype: Dtype for the floating-point weights.
        device: Device for the weights.
        model_impl: ``auto``, ``native`` or ``transformers``.

    Returns:
        ``(model, hf_config)``: a :class:`~engine.models.llama.LlamaForCausalLM` or
        :class:`~engine.models.llava.LlavaForConditionalGeneration` in eval mode without
        gradients, and the ``transformers`` config it was built from.

    Raises:
        FileNotFoundError: a missing directory, ``config.json`` or weights.
        ValueError: an unsupported architecture, pickle-only weights, missing, unexpected or
            mis-shaped tensors.
    """
    path = Path(model_dir)
    hf_config = load_config(path)
    if resolve_model_impl(hf_config, model_impl) == "transformers":
        from loraplex.engine.models.transformers_backend import load_transformers_model

        return load_transformers_model(path, hf_config, dtype, device), hf_config
    multimodal = is_multimodal(hf_config)
    files = weight_files(path)
    with torch.device("meta"):
        model = build_model(hf_config)
    plan = _plan(model, sorted(files), multimodal, path)
    shapes = separate_shapes(model)
    fused_shapes = {name: t.shape for name, t in model.state_dict().items()}
    state = {}
    for name, tensor in read_tensors(files, plan):
        shape, fused, start = shapes[name]
        if tensor.shape != shape:
            into = f" (rows {start}:{start + shape[0]} of {fused!r})" if fused else ""
            raise ValueError(
                f"{path}: tensor for {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(shape)}{into}"
            )
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if fused is None:
            state[name] = tensor.to(device)
            continue
        if fused not in state:  # every row is written: _plan checked each slice is present
            state[fused] = torch.empty(fused_shapes[fused], dtype=tensor.dtype, device=device)
        state[fused][start : start + shape[0]].copy_(tensor)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.eval()
    model.requires_grad_(False)
    return model, hf_config
