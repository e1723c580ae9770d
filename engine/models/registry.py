"""Which Hugging Face architectures the engine runs, and which implementation runs each.

Two implementations (``--model-impl``, vLLM's flag): ``native``, the engine's own model code
for the architectures in :data:`SUPPORTED_ARCHITECTURES` (the fast path), and
``transformers``, transformers' modeling code over the paged KV cache for any causal-LM or
image-text-to-text architecture it has (``engine.models.transformers_backend``). ``auto`` takes
the native model where one exists and accepts the config, else the transformers backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loraplex.engine.models.config import DecoderConfig, VisionConfig
from loraplex.engine.models.llama import LlamaForCausalLM
from loraplex.engine.models.llava import LlavaForConditionalGeneration

MODEL_IMPLS = ("auto", "native", "transformers")
TEXT_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration",)
SUPPORTED_ARCHITECTURES = TEXT_ARCHITECTURES + MULTIMODAL_ARCHITECTURES

# Used when a config.json names no architecture.
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llava": "LlavaForConditionalGeneration",
}


def _unsupported(name: str) -> ValueError:
    return ValueError(
        f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def architecture_of(hf_config: Any) -> str:
    """The config's architecture name (``config.architectures[0]``, else by model type).

    Raises:
        ValueError: an architecture or model type the engine does not support.
    """
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures:
        name = architectures[0]
    else:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in _BY_MODEL_TYPE:
            raise _unsupported(f"model_type={model_type}")
        name = _BY_MODEL_TYPE[model_type]
    if name not in SUPPORTED_ARCHITECTURES:
        raise _unsupported(name)
    return name


def _name_of(hf_config: Any) -> str:
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures:
        return architectures[0]
    model_type = getattr(hf_config, "model_type", None)
    return _BY_MODEL_TYPE.get(model_type, f"model_type={model_type}")


def resolve_model_impl(hf_config: Any, model_impl: str = "auto") -> str:
    """``"native"`` or ``"transformers"``: which implementation serves ``hf_config``.

    Args:
        hf_config: The checkpoint's transformers config.
        model_impl: ``auto``, ``native`` or ``transformers``.

    Raises:
        ValueError: an unknown ``model_impl``; ``native`` for an architecture without native
            code, or a config the native code refuses; ``transformers`` (or ``auto`` without a
            native model) for a config the transformers backend cannot serve.
    """
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"unknown model_impl {model_impl!r}; expected one of {MODEL_IMPLS}")
    name = _name_of(hf_config)
    native_error = None
    if model_impl in ("auto", "native"):
        if name not in SUPPORTED_ARCHITECTURES:
            native_error = (
                f"no native model for {name!r} (native: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        else:
            try:
                with torch.device("meta"):
                    build_model(hf_config)
                return "native"
            except ValueError as exc:
                native_error = f"the native {name} refuses this config: {exc}"
        if model_impl == "native":
            raise ValueError(f"{native_error}; --model-impl transformers may serve it")
    from loraplex.engine.models.transformers_backend.loader import supports

    reason = supports(hf_config)
    if reason is None:
        return "transformers"
    if native_error is not None:
        raise ValueError(f"unsupported model {name!r}: {native_error}, and {reason}")
    raise ValueError(f"unsupported model {name!r} for the transformers backend: {reason}")


def is_multimodal(hf_config: Any) -> bool:
    """Whether the config describes a vision-language model."""
    return architecture_of(hf_config) in MULTIMODAL_ARCHITECTURES


def build_model(hf_config: Any) -> nn.Module:
    """An uninitialized engine model for ``hf_config``.

    Build it under ``torch.device("meta")`` and load the weights with
    :func:`engine.models.loader.load_model`.

    Raises:
        ValueError: an unsupported architecture, or a config it cannot run.
    """
    name = architecture_of(hf_config)
    if name in TEXT_ARCHITECTURES:
        return LlamaForCausalLM(DecoderConfig.from_hf(hf_config))
    text_config = DecoderConfig.from_hf(
        hf_config.text_config,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )
    return LlavaForConditionalGeneration(
        text_config,
        VisionConfig.from_hf(hf_config),
        image_token_id=int(hf_config.image_token_id),
        projector_hidden_act=hf_config.projector_hidden_act,
        projector_bias=bool(getattr(hf_config, "multimodal_projector_bias", True)),
    )
