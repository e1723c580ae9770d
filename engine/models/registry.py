"""Which Hugging Face architectures the engine runs, and how each is built from its config."""

from __future__ import annotations

from typing import Any

from torch import nn

from loraplex.engine.models.config import DecoderConfig, VisionConfig
from loraplex.engine.models.llama import LlamaForCausalLM
from loraplex.engine.models.llava import LlavaForConditionalGeneration

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
