"""LLaVA: a CLIP vision tower and a two-layer projector in front of a Llama-family decoder.

The runner, not the model, splices images in: it embeds the prompt with :meth:`embed_tokens`,
overwrites the rows at ``image_token_id`` positions with :meth:`encode_images`'s features (in
order, ``num_image_tokens`` rows per image) and passes the result as ``inputs_embeds``. That
keeps encodings cacheable per image and lets a prefill chunk start or end inside an image.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from loraplex.engine.attention import AttentionBackend, AttentionMetadata
from loraplex.engine.models.clip import CLIPVisionTower
from loraplex.engine.models.config import DecoderConfig, VisionConfig
from loraplex.engine.models.layers import get_activation
from loraplex.engine.models.llama import KVCaches, LlamaForCausalLM


class LlavaMultiModalProjector(nn.Module):
    """``linear_2(act(linear_1(features)))``: vision width (times feature layers) to text width.

    Args:
        in_features: Vision hidden size times the number of feature layers.
        out_features: Text hidden size.
        hidden_act: ``projector_hidden_act``.
        bias: ``multimodal_projector_bias``.
    """

    def __init__(self, in_features: int, out_features: int, hidden_act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, out_features, bias=bias)
        self.linear_2 = nn.Linear(out_features, out_features, bias=bias)
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features] -> [..., out_features]``."""
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    """LLaVA-1.5-style vision-language model; the text interface is :class:`LlamaForCausalLM`'s.

    Args:
        text_config: The language model.
        vision_config: The vision tower.
        image_token_id: The ``<image>`` placeholder token.
        projector_hidden_act: Activation between the projector's two linears.
        projector_bias: Whether the projector's linears have biases.
    """

    supports_cuda_graphs = True
    """Its forward over a pure-decode step makes no host read of device values and no
    value-dependent branch, so it can be captured (``engine.runner.cuda_graphs``)."""

    supports_prepacked_weights = True
    """Its language model and projector only call their linears, so they can be
    oneDNN-prepacked on the CPU (``engine.models.packed_linear``)."""

    def __init__(
        self,
        text_config: DecoderConfig,
        vision_config: VisionConfig,
        image_token_id: int,
        projector_hidden_act: str,
        projector_bias: bool,
    ) -> None:
        super().__init__()
        self.image_token_id = image_token_id
        self.vision_tower = CLIPVisionTower(vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision_config.hidden_size * len(vision_config.feature_layers),
            text_config.hidden_size,
            projector_hidden_act,
            projector_bias,
        )
        self.language_model = LlamaForCausalLM(text_config)

    @property
    def config(self) -> DecoderConfig:
        """The language model's config."""
        return self.language_model.config

    @property
    def vision_config(self) -> VisionConfig:
        """The vision tower's config."""
        return self.vision_tower.config

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (feature rows) per image."""
        return self.vision_tower.config.num_image_tokens

    @property
    def image_size(self) -> int:
        """Expected pixel height and width."""
        return self.vision_tower.config.image_size

    @property
    def num_layers(self) -> int:
        """Decoder layers (one ``(k_cache, v_cache)`` pair each)."""
        return self.language_model.num_layers

    @property
    def num_heads(self) -> int:
        """Query heads."""
        return self.language_model.num_heads

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer."""
        return self.language_model.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Per-head size."""
        return self.language_model.head_dim

    @property
    def hidden_size(self) -> int:
        """Text model width."""
        return self.language_model.hidden_size

    @property
    def vocab_size(self) -> int:
        """Rows of the logits."""
        return self.language_model.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        """The language model's longest context."""
        return self.language_model.max_position_embeddings

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights and activations."""
        return self.language_model.dtype

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.language_model.device

    def tie_weights(self) -> None:
        """Re-tie the language model's ``lm_head`` to its embeddings (when configured)."""
        self.language_model.tie_weights()

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Project images into the text embedding space.

        Args:
            pixel_values: ``[N, 3, image_size, image_size]`` processed pixels (the processor's
                ``pixel_values``).

        Returns:
            ``[N, num_image_tokens, hidden]`` in the model's dtype.
        """
        features = self.vision_tower(
            pixel_values.to(self.vision_tower.embeddings.class_embedding.dtype)
        )
        return self.multi_modal_projector(features).to(self.dtype)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ``[T] -> [T, hidden]`` (image placeholders embed as the token)."""
        return self.language_model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step of the language model; see :meth:`LlamaForCausalLM.forward`.

        Pass ``inputs_embeds`` with the image features spliced in for steps that contain image
        placeholder tokens; ``input_ids`` alone embeds placeholders as plain tokens.
        """
        return self.language_model(input_ids, positions, kv_caches, meta, backend, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` float32 logits."""
        return self.language_model.compute_logits(hidden_states)

    def lora_targets(self) -> Iterator[tuple[int, str, nn.Linear]]:
        """The language model's LoRA targets (see :meth:`LlamaForCausalLM.lora_targets`)."""
        return self.language_model.lora_targets()
