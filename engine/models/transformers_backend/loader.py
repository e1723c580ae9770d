"""Load a checkpoint through transformers' Auto classes with the engine's paged attention."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.models.transformers_backend.attention import ATTN_IMPLEMENTATION, register
from loraplex.engine.models.transformers_backend.model import (
    TransformersForCausalLM,
    check_text_config,
)
from loraplex.engine.models.transformers_backend.probe import check_paged_attention
from loraplex.engine.models.transformers_backend.vision import TransformersForImageTextToText

logger = logging.getLogger(__name__)


def model_class_of(hf_config: Any) -> tuple[Any | None, str | None]:
    """The transformers class that builds ``hf_config``'s model with an LM head.

    The class transformers' ``AutoModelForImageTextToText`` maps the model type to, for a
    config with a ``vision_config``, else ``AutoModelForCausalLM``'s; the config's
    ``architectures[0]``, when given, must name that class.

    Returns:
        ``(class, None)``, or ``(None, why not)``: a model type neither Auto class maps (an
        encoder, a speech model, a remote-code architecture), or an architecture that is not
        the model type's.
    """
    import transformers
    from transformers.models.auto import modeling_auto as auto

    model_type = getattr(hf_config, "model_type", None)
    vision = getattr(hf_config, "vision_config", None) is not None
    mapping = (
        auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        if vision
        else auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    expected = mapping.get(model_type)
    kind = "image-text-to-text" if vision else "causal-LM"
    if expected is None:
        return None, f"transformers has no {kind} model for model_type {model_type!r}"
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures and architectures[0] != expected:
        return None, (
            f"architecture {architectures[0]!r} is not the {kind} model of model_type "
            f"{model_type!r} ({expected})"
        )
    cls = getattr(transformers, expected, None)
    if cls is None:
        return None, f"this transformers has no {expected}"
    return cls, None


def supports(hf_config: Any) -> str | None:
    """Why the transformers backend cannot serve ``hf_config``, or None when it can."""
    cls, reason = model_class_of(hf_config)
    if cls is None:
        return reason
    try:
        check_text_config(hf_config.get_text_config())
    except ValueError as exc:
        return str(exc)
    return None


def _attn_implementation(hf_config: Any) -> str | dict:
    """The paged attention for the text decoder; vision towers keep SDPA."""
    if getattr(hf_config, "vision_config", None) is None:
        return ATTN_IMPLEMENTATION
    implementation: dict[str, str] = {"": "sdpa"}
    for key in hf_config.sub_configs:
        sub = getattr(hf_config, key, None)
        if sub is not None:
            implementation[key] = "sdpa"
    text_key = next(
        (
            k
            for k in hf_config.sub_configs
            if getattr(hf_config, k, None) is hf_config.get_text_config()
        ),
        None,
    )
    if text_key is None:
        raise ValueError("cannot find the text decoder's config among the model's sub-configs")
    implementation[text_key] = ATTN_IMPLEMENTATION
    return implementation


def load_transformers_model(
    model_dir: str | Path, hf_config: Any, dtype: torch.dtype, device: str | torch.device
) -> TransformersForCausalLM:
    """Build ``hf_config``'s transformers model from ``model_dir`` for the engine.

    Args:
        model_dir: A model directory (``config.json`` and weights).
        hf_config: Its config, already read.
        dtype: Dtype of the floating-point weights.
        device: Where the weights go.

    Returns:
        The wrapped model, in eval mode without gradients: a
        :class:`TransformersForImageTextToText` for a config with a ``vision_config``.

    Raises:
        ValueError: an architecture transformers cannot build here, a checkpoint that lacks
            tensors the model needs (transformers would initialise them at random) or has
            tensors of the wrong shape, or a model whose attention the engine's paged attention
            does not reproduce (:func:`.probe.check_paged_attention`).
    """
    reason = supports(hf_config)
    if reason is not None:
        raise ValueError(reason)
    register()
    cls, _ = model_class_of(hf_config)
    implementation = _attn_implementation(hf_config)
    try:
        hf_model, info = cls.from_pretrained(
            str(model_dir),
            config=hf_config,
            dtype=dtype,
            attn_implementation=implementation,
            output_loading_info=True,
        )
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        hint = ""
        if not getattr(cls, "_supports_attention_backend", False):
            hint = (
                f" ({cls.__name__} does not declare transformers' attention-backend support: "
                "the transformers backend plugs its paged attention into AttentionInterface)"
            )
        raise ValueError(f"transformers cannot load {model_dir}: {exc!r}{hint}") from exc
    missing = sorted(info.get("missing_keys") or [])
    mismatched = info.get("mismatched_keys") or []
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" ... and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise ValueError(f"{model_dir}: checkpoint is missing tensors: {shown}")
    if mismatched:
        raise ValueError(f"{model_dir}: tensors of the wrong shape: {mismatched[:8]}")
    unexpected = info.get("unexpected_keys") or []
    if unexpected:
        logger.warning("%s: %d checkpoint tensors unused by transformers, e.g. %s",
                       model_dir, len(unexpected), sorted(unexpected)[:4])  # fmt: skip
    hf_model.to(device)
    hf_model.eval()
    hf_model.requires_grad_(False)
    if getattr(hf_config, "vision_config", None) is not None:
        model = TransformersForImageTextToText(hf_model)
    else:
        model = TransformersForCausalLM(hf_model)
    check_paged_attention(model)
    return model
