"""One image at a time out of a processor's batch: its placeholder span and its own model inputs.

A vision-language processor (transformers' ``AutoProcessor``) expands each image of a prompt
into a variable number of placeholder tokens, sometimes split into runs by other tokens
(Idefics3's ``<row_i_col_j>`` markers, Pixtral's ``[IMG_BREAK]``), and returns the prompt's
images as one batch of tensors. The engine encodes and caches each image alone
(docs/vision_models.md), so :func:`split_images` finds, for every image in order:

- its image tokens: the processor's ``text_replacement_offsets`` give each image's replacement
  text, whose image tokens (counted by tokenizing it) are the next ones of the prompt; without
  them, each maximal run of image tokens is one image;
- its placeholder span: first to last of its image tokens (what its key is hashed into);
- its own slice of every batched tensor (:func:`slice_inputs`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

TEXT_KEYS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "mm_token_type_ids",
        "text_replacement_offsets",
        "offset_mapping",
        "assistant_masks",
    }
)
"""Processor outputs that belong to the text, not to any image."""

WHOLE_KEYS = frozenset({"batch_num_images"})
"""Per-prompt image inputs every image keeps whole (LLaVA-OneVision: how many images the prompt
has, which decides whether each is tiled)."""

_SMALL = 64  # integer inputs up to this many values are part of an image's variant


@dataclass(frozen=True)
class ImageSlice:
    """One image of a processed prompt.

    Attributes:
        offset: Position of its first image token in the prompt.
        length: First to last of its image tokens (other tokens in between included).
        num_tokens: Its image tokens (the feature rows its encoding must have).
        pixel_values: Its ``pixel_values``.
        inputs: Its other processor outputs, by name.
    """

    offset: int
    length: int
    num_tokens: int
    pixel_values: torch.Tensor
    inputs: dict[str, torch.Tensor]

    def variant(self) -> str:
        """A short digest of what besides its pixels decides the image's features.

        Its token count and its small integer inputs (sizes, grids, the prompt's image count):
        the same picture processed otherwise (LLaVA-OneVision tiles a lone image, not one of
        several) gets another key, so it shares neither features nor KV blocks.
        """
        parts: list[object] = [self.num_tokens]
        for name in sorted(self.inputs):
            value = self.inputs[name]
            if not value.is_floating_point() and value.numel() <= _SMALL:
                parts.append((name, value.tolist()))
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def image_token_counts(
    ids: list[int],
    image_token_id: int,
    num_images: int,
    replacements: list[str] | None,
    tokenizer,
) -> list[int]:
    """How many image tokens each image has, in order (see the module docstring).

    Args:
        ids: The prompt's token ids.
        image_token_id: The placeholder token.
        num_images: Images in the prompt.
        replacements: Each image's replacement text from the processor, or None.
        tokenizer: The tokenizer that tokenized the prompt.

    Raises:
        ValueError: the counts cannot be found or do not add up to the prompt's image tokens.
    """
    total = ids.count(image_token_id)
    if replacements is not None and len(replacements) == num_images:
        counts = [
            tokenizer(text, add_special_tokens=False)["input_ids"].count(image_token_id)
            for text in replacements
        ]
    else:
        counts = [length for _, length in placeholder_runs(ids, image_token_id)]
    if len(counts) != num_images or sum(counts) != total or 0 in counts:
        raise ValueError(
            f"cannot tell the prompt's {total} image tokens apart into {num_images} image(s)"
        )
    return counts


def split_images(
    ids: list[int],
    image_token_id: int,
    encoded: dict,
    num_images: int,
    tokenizer,
) -> list[ImageSlice]:
    """Each image's span and inputs (see the module docstring).

    Args:
        ids: The prompt's token ids.
        image_token_id: The placeholder token.
        encoded: The processor's outputs (tensors, and ``text_replacement_offsets`` if given).
        num_images: Images in the prompt.
        tokenizer: The processor's tokenizer.

    Raises:
        ValueError: tokens that cannot be told apart per image, or outputs that cannot be
            sliced per image.
    """
    offsets = encoded.get("text_replacement_offsets")
    replacements = None
    if offsets:
        entries = offsets[0] if offsets and isinstance(offsets[0], list) else offsets
        replacements = [e["replacement"] for e in entries if e.get("type", "image") == "image"]
    counts = image_token_counts(ids, image_token_id, num_images, replacements, tokenizer)
    positions = [i for i, t in enumerate(ids) if t == image_token_id]
    batched = {
        k: v for k, v in encoded.items() if k not in TEXT_KEYS and isinstance(v, torch.Tensor)
    }
    if "pixel_values" not in batched:
        raise ValueError("the processor returned no pixel_values")
    per_image = slice_inputs(batched, counts)
    out = []
    start = 0
    for count, inputs in zip(counts, per_image, strict=True):
        first, last = positions[start], positions[start + count - 1]
        start += count
        pixel_values = inputs.pop("pixel_values")
        out.append(ImageSlice(first, last - first + 1, count, pixel_values, inputs))
    return out


def slice_inputs(batched: dict[str, torch.Tensor], counts: list[int]) -> list[dict]:
    """Cut a prompt's batched image inputs into one dict per image.

    Rules, by what transformers' processors return:

    - ``image_grid_thw`` ``[N, 3]`` (Qwen2-VL family): a row per image, and ``pixel_values``
      (flattened patches) ``t * h * w`` rows per image;
    - ``batch_num_images`` is kept whole by every image (:data:`WHOLE_KEYS`);
    - a tensor whose first dimension is the image count: a row per image (``image_sizes``;
      ``pixel_values`` of LLaVA-NeXT/OneVision, Pixtral, Gemma 3), kept as a batch of one;
    - otherwise ``pixel_values`` and ``pixel_attention_mask`` hold crops in proportion to the
      image tokens (every crop gives the same number of tokens): along dimension 1 when the
      first is a batch of one (Idefics3, SmolVLM: ``[1, crops, 3, H, W]``), else along
      dimension 0 (Gemma 3's pan-and-scan crops).

    Raises:
        ValueError: a tensor none of the rules cuts.
    """
    n = len(counts)
    if n == 1:
        return [{k: v.clone() for k, v in batched.items()}]
    out: list[dict] = [{} for _ in range(n)]
    grid = batched.get("image_grid_thw")
    for name, value in batched.items():
        if name in WHOLE_KEYS:
            parts = [value] * n
        elif grid is not None and name in ("pixel_values", "pixel_attention_mask"):
            parts = list(value.split(grid.prod(-1).tolist(), dim=0))
        elif value.dim() > 0 and value.shape[0] == n:
            parts = list(value.split(1, dim=0))
        elif name in ("pixel_values", "pixel_attention_mask"):
            dim = 1 if value.shape[0] == 1 and value.dim() >= 2 else 0
            parts = list(value.split(_proportional(value.shape[dim], counts, name), dim=dim))
        else:
            raise ValueError(f"cannot cut the processor's {name!r} {tuple(value.shape)} per image")
        for d, part in zip(out, parts, strict=True):
            d[name] = part.clone()
    return out


def _proportional(rows: int, counts: list[int], name: str) -> list[int]:
    total = sum(counts)
    sizes = [rows * c // total for c in counts]
    if any(rows * c % total for c in counts) or sum(sizes) != rows:
        raise ValueError(f"cannot cut {name}'s {rows} crops over images of {counts} tokens")
    return sizes


def placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each maximal run of ``token_id`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(ids):
        if t == token_id:
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i - start))
            start = None
    if start is not None:
        runs.append((start, len(ids) - start))
    return runs
