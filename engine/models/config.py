"""Frozen, scalar-only model configs read once from a Hugging Face config.

The model classes take these, never the Hugging Face config object, so every value a layer
depends on is explicit (and a test can build a model without ``transformers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Rope types whose frequencies do not depend on the sequence length ("dynamic" and "longrope"
# change with it and are not supported).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_parameters(hf_config: Any) -> dict:
    """The config's rope parameters in transformers 5's form (``rope_type``, ``rope_theta``)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers 4 form: rope_theta + rope_scaling
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def rope_frequencies(hf_config: Any, head_dim: int) -> tuple[tuple[float, ...], float]:
    """Inverse frequencies and attention scaling, exactly as ``transformers`` computes them.

    Uses ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` for scaled rope types
    (``linear``, ``llama3``, ``yarn``), and the Llama default formula otherwise.

    Args:
        hf_config: A Llama, Mistral or Qwen2 ``PretrainedConfig`` (text config).
        head_dim: Per-head size.

    Returns:
        ``(inv_freq, attention_scaling)``: ``head_dim // 2`` floats and a factor.

    Raises:
        ValueError: an unsupported rope type (``dynamic``, ``longrope``, ...).
    """
    params = _rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    with torch.device("cpu"):  # even when the model is being built on the meta device
        if rope_type == "default":
            base = float(params["rope_theta"])
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return tuple(inv_freq.float().tolist()), float(scaling)


@dataclass(frozen=True)
class DecoderConfig:
    """A Llama-family decoder (Llama, Mistral, Qwen2), scalars only.

    Attributes:
        model_type: ``"llama"``, ``"mistral"`` or ``"qwen2"``.
        vocab_size: Embedding rows.
        hidden_size: Model width.
        intermediate_size: MLP width.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (GQA when fewer than ``num_heads``).
        head_dim: Per-head size.
        rms_norm_eps: RMSNorm epsilon.
        hidden_act: MLP activation.
        qkv_bias: q/k/v projections have biases (Qwen2; Llama's ``attention_bias``).
        o_bias: o_proj has a bias (Llama's ``attention_bias``).
        mlp_bias: MLP projections have biases (Llama's ``mlp_bias``).
        tie_word_embeddings: ``lm_head`` shares the embedding matrix.
        sliding_windows: Per layer, the attention window (``None`` for full attention).
        rope_inv_freq: ``head_dim // 2`` rotary inverse frequencies.
        rope_attention_scaling: Factor on rotary cos/sin.
        max_position_embeddings: The model's longest context.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    rope_inv_freq: tuple[float, ...]
    rope_attention_scaling: float
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, hf_config: Any, tie_word_embeddings: bool | None = None) -> DecoderConfig:
        """Read a Llama/Mistral/Qwen2 ``PretrainedConfig``.

        Args:
            hf_config: The (text) config.
            tie_word_embeddings: Override (LLaVA decides tying on its top-level config).

        Raises:
            ValueError: an unsupported model type, rope type or layer type.
        """
        model_type = hf_config.model_type
        if model_type not in TEXT_MODEL_TYPES:
            raise ValueError(
                f"unsupported text model type {model_type!r}; supported: "
                f"{', '.join(TEXT_MODEL_TYPES)}"
            )
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        num_layers = hf_config.num_hidden_layers
        window = getattr(hf_config, "sliding_window", None)
        layer_types = getattr(hf_config, "layer_types", None)
        if layer_types:
            unknown = set(layer_types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise ValueError(f"unsupported layer types {sorted(unknown)}")
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:
            windows = (window,) * num_layers
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        inv_freq, scaling = rope_frequencies(hf_config, head_dim)
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            hidden_act=hf_config.hidden_act,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            tie_word_embeddings=tie_word_embeddings,
            sliding_windows=windows,
            rope_inv_freq=inv_freq,
            rope_attention_scaling=scaling,
            max_position_embeddings=hf_config.max_position_embeddings,
        )


@dataclass(frozen=True)
class VisionConfig:
    """A CLIP vision tower, as far as LLaVA runs it.

    Attributes:
        hidden_size: Tower width.
        intermediate_size: MLP width.
        num_heads: Attention heads.
        num_layers_run: Encoder layers actually run (up to the deepest feature layer).
        image_size: Input height and width (square).
        patch_size: Patch height and width.
        num_channels: Input channels.
        layer_norm_eps: LayerNorm epsilon.
        hidden_act: MLP activation (``quick_gelu`` for OpenAI CLIP).
        feature_layers: Indices into the tower's hidden states (0 = embeddings after the
            pre-layernorm, ``i`` = output of encoder layer ``i - 1``), already non-negative.
        keep_cls: ``vision_feature_select_strategy == "full"``.
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers_run: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    feature_layers: tuple[int, ...]
    keep_cls: bool

    @property
    def num_patches(self) -> int:
        """Patches per image."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Feature vectors (placeholder tokens) per image."""
        return self.num_patches + (1 if self.keep_cls else 0)

    @classmethod
    def from_hf(cls, llava_config: Any) -> VisionConfig:
        """Read a ``LlavaConfig``'s vision part (``vision_config`` must be CLIP).

        Raises:
            ValueError: a non-CLIP tower, a bad feature layer or selection strategy.
        """
        vc = llava_config.vision_config
        if vc.model_type != "clip_vision_model":
            raise ValueError(
                f"unsupported vision tower {vc.model_type!r}; supported: clip_vision_model"
            )
        total = vc.num_hidden_layers
        layer = llava_config.vision_feature_layer
        layers = [layer] if isinstance(layer, int) else list(layer)
        normalized = []
        for index in layers:
            if not -(total + 1) <= index <= total:
                raise ValueError(
                    f"vision_feature_layer {index} is out of range for a tower of {total} layers"
                )
            normalized.append(index % (total + 1))
        strategy = llava_config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}")
        return cls(
            hidden_size=vc.hidden_size,
            intermediate_size=vc.intermediate_size,
            num_heads=vc.num_attention_heads,
            num_layers_run=max(normalized),
            image_size=vc.image_size,
            patch_size=vc.patch_size,
            num_channels=vc.num_channels,
            layer_norm_eps=float(vc.layer_norm_eps),
            hidden_act=vc.hidden_act,
            feature_layers=tuple(normalized),
            keep_cls=strategy == "full",
        )
