"""Any transformers image-text-to-text model: its text decoder over our KV, its own image encoder.

:class:`TransformersForImageTextToText` is :class:`.model.TransformersForCausalLM` (the text
decoder runs over the paged KV cache) plus what the model runner needs for images
(docs/vision_models.md):

- ``image_token_id``: the placeholder token whose positions take image features.
- :meth:`encode_image`: one image's features, ``[n_tokens, hidden]``, from the model's own
  ``get_image_features`` on that image's processor outputs alone (pixel values and whatever else
  its processor made for it: ``image_sizes``, ``pixel_attention_mask``, ``image_grid_thw`` ...),
  flattened in the order transformers' ``masked_scatter`` places them on the image's
  placeholder tokens.
- ``bidirectional_image_spans``: the model's image tokens attend to each other in both
  directions (Gemma 3's ``token_type_ids`` mask), so the attention lets every token of an image
  see the whole image, and the scheduler never splits one image over two steps.
- ``mrope`` and :meth:`rope_positions`: a model with multimodal rotary positions (Qwen2-VL,
  Qwen2.5-VL, Qwen3-VL: 3-D temporal/height/width position ids) gets a prompt's ``[3, P]``
  positions and the delta later tokens add to their position, from the model's own
  ``get_rope_index``.
- Deepstack (Qwen3-VL): the vision tower also gives features that the decoder adds to the
  image tokens' hidden states after its first layers. :meth:`encode_image` returns them as
  more columns of the image's features (``[n, hidden * (1 + layers)]``, cached as one), and
  :meth:`forward` takes the step's rows of them (``deepstack``) and hands them to the decoder
  as transformers' ``visual_pos_masks`` and ``deepstack_visual_embeds``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from loraplex.engine.models.transformers_backend.model import TransformersForCausalLM

BIDIRECTIONAL_IMAGE_MODEL_TYPES = frozenset({"gemma3"})
"""Model types whose text decoder attends bidirectionally within each image's tokens (their
``get_block_sequence_ids_for_mask`` / ``token_type_ids`` masks in transformers)."""

_IMAGE_TOKEN_FIELDS = ("image_token_id", "image_token_index")


def image_token_id_of(hf_config: Any) -> int | None:
    """The image placeholder token id a vision-language config names, None if it names none."""
    for field in _IMAGE_TOKEN_FIELDS:
        value = getattr(hf_config, field, None)
        if isinstance(value, int):
            return value
    return None


class TransformersForImageTextToText(TransformersForCausalLM):
    """An ``AutoModelForImageTextToText`` model run by the engine (see the module docstring).

    Args:
        hf_model: The transformers model, text attention ``"loraplex"``
            (``.loader.load_transformers_model``).

    Raises:
        ValueError: what :class:`TransformersForCausalLM` raises, a config with no image token,
            or a model without ``get_image_features``.
    """

    num_image_tokens = 0
    """Placeholder tokens per image: 0, it varies with the image (the processor says)."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        super().__init__(hf_model)
        token = image_token_id_of(self.hf_config)
        if token is None:
            raise ValueError(f"{type(hf_model).__name__}'s config names no image token id")
        if not callable(getattr(hf_model, "get_image_features", None)):
            raise ValueError(f"{type(hf_model).__name__} has no get_image_features")
        self.image_token_id = token
        self.bidirectional_image_spans = (
            getattr(self.hf_config, "model_type", None) in BIDIRECTIONAL_IMAGE_MODEL_TYPES
        )
        inner = getattr(hf_model, "model", None)
        self._rope_index = getattr(inner, "get_rope_index", None)
        self.mrope = callable(self._rope_index)
        params = inspect.signature(hf_model.get_image_features).parameters
        self._feature_args = frozenset(
            name
            for name, p in params.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        )

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, ``[T] -> [T, hidden]``.

        An image token id past the embedding's rows embeds as id 0 (its rows are overwritten
        by features), as transformers does.
        """
        rows = self.hf.get_input_embeddings().weight.shape[0]
        if self.image_token_id >= rows:
            input_ids = input_ids.masked_fill(input_ids == self.image_token_id, 0)
        return super().embed_tokens(input_ids)

    @torch.inference_mode()
    def encode_image(
        self, pixel_values: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One image's features in placeholder order.

        Args:
            pixel_values: The image's ``pixel_values`` from its processor (any shape the model's
                ``get_image_features`` takes for one image).
            inputs: Its other processor outputs by name; those ``get_image_features`` does not
                take are left out.

        Returns:
            ``[n_tokens, hidden]`` in the model's dtype.

        Raises:
            ValueError: the model returned features of an unexpected form.
        """
        kwargs: dict[str, Any] = {
            "pixel_values": pixel_values.to(device=self.device, dtype=self.dtype)
        }
        for name, value in inputs.items():
            if name in self._feature_args:
                value = value.to(self.device)
                kwargs[name] = value.to(self.dtype) if value.is_floating_point() else value
        out = self.hf.get_image_features(**kwargs)
        columns = [_rows(getattr(out, "pooler_output", out))]
        columns += [_rows(f) for f in getattr(out, "deepstack_features", None) or ()]
        if any(c is None or c.shape[-1] != self.hidden_size for c in columns):
            raise ValueError(f"{type(self.hf).__name__}.get_image_features gave no features")
        return torch.cat(columns, dim=-1).to(self.dtype)

    def forward(self, *args: Any, deepstack=None, **kwargs: Any) -> torch.Tensor:
        """:meth:`TransformersForCausalLM.forward`, with the step's deepstack rows if any.

        Args:
            *args: Those of :meth:`TransformersForCausalLM.forward`.
            deepstack: ``([T] bool mask of image-token rows, [T, hidden * layers] their
                deepstack features)`` or None (``engine.runner.model_runner``).
            **kwargs: Those of :meth:`TransformersForCausalLM.forward`.
        """
        if deepstack is not None:
            mask, extra = deepstack
            rows = extra[mask]
            kwargs["visual_pos_masks"] = mask[None]
            kwargs["deepstack_visual_embeds"] = list(rows.split(self.hidden_size, dim=-1))
        return super().forward(*args, **kwargs)

    @torch.inference_mode()
    def rope_positions(
        self, token_ids: list[int], grids: list[torch.Tensor]
    ) -> tuple[torch.Tensor, int]:
        """A prompt's multimodal rotary positions (``mrope`` models only).

        Args:
            token_ids: The prompt.
            grids: Each image's ``image_grid_thw`` (``[1, 3]``), in prompt order.

        Returns:
            ``([3, P] int64 positions, delta)``: a later token at position ``p`` (generated, or
            past the prompt) has position ``p + delta`` in all three sections, as transformers'
            ``generate`` continues (its ``rope_deltas``).

        Raises:
            ValueError: an image without its ``image_grid_thw``.
        """
        if any(g is None for g in grids):
            raise ValueError("an image without image_grid_thw: no rotary positions for it")
        ids = torch.tensor([token_ids], device=self.device)
        types = (ids == self.image_token_id).int()
        grid = torch.cat([g.reshape(-1, 3) for g in grids]).to(self.device) if grids else None
        positions, delta = self._rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid)
        return positions[:, 0].long(), int(delta.reshape(-1)[0])


def _rows(features: Any) -> torch.Tensor | None:
    """Features (a tensor, or one per image or crop) as ``[n, width]`` rows, in order."""
    if isinstance(features, list | tuple):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features], dim=0)
    if not isinstance(features, torch.Tensor):
        return None
    return features.reshape(-1, features.shape[-1])
