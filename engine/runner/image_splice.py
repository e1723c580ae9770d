"""Where an image's features go among a step's rows, how far its tokens look, their positions.

An image's placeholder span (``ImageInput.placeholder``) runs from its first image token to its
last; a transformers vision-language model may put other tokens between them (Idefics3's row
markers, Pixtral's ``[IMG_BREAK]``), which embed as text. Its features, ``[n, hidden]`` with
``n`` the span's image tokens, go to those image tokens in order, so a prefill chunk that covers
positions ``first .. first + count`` of the span takes the features after the image tokens
before ``first`` (docs/vision_models.md). The native LLaVA's spans are all image tokens: its
features are a plain slice, as before.
"""

from __future__ import annotations

import dataclasses

import torch

from loraplex.engine.attention.metadata import StepInputs
from loraplex.hashing.extra_keys import MMPlaceholder


def splice_rows(
    token_ids: list[int],
    placeholder: MMPlaceholder,
    first: int,
    count: int,
    image_token_id: int | None,
    num_features: int,
) -> tuple[list[int] | None, int]:
    """Which of a chunk's rows of an image span take features, and from which feature row.

    Args:
        token_ids: The sequence's tokens.
        placeholder: The image's span.
        first: First span position the chunk covers (0 = the span's first token).
        count: Span positions the chunk covers.
        image_token_id: The placeholder token (None: every span position is one).
        num_features: Rows of the image's features.

    Returns:
        ``(rows, start)``: the chunk's rows (0-based in the chunk) that are image tokens, None
        when all of them are; and the feature row the first of them takes.

    Raises:
        ValueError: the image's features are not one row per image token of its span.
    """
    span = token_ids[placeholder.offset : placeholder.end]
    if image_token_id is None:
        if num_features != len(span):
            raise ValueError(f"{num_features} image features for a span of {len(span)} tokens")
        return None, first
    total = span.count(image_token_id)
    if num_features != total:
        raise ValueError(f"{num_features} image features for {total} image tokens")
    piece = span[first : first + count]
    start = span[:first].count(image_token_id)
    if all(t == image_token_id for t in piece):
        return None, start
    return [i for i, t in enumerate(piece) if t == image_token_id], start


def with_image_bounds(inputs: StepInputs, chunks: list[tuple[int, list]]) -> StepInputs:
    """The step's inputs with each image token seeing its whole image (bidirectional images).

    Args:
        inputs: The step's inputs.
        chunks: ``(first row in the step, [(span, placeholder), ...])`` per sequence: each
            ``ImageSpan`` of its chunk and the image's placeholder.

    Returns:
        ``inputs`` with ``metadata.visible_up_to`` set (every row its own position, an image's
        rows the last position of the image), or ``inputs`` itself when no image is in the step.
    """
    bounds = None
    for q0, spans in chunks:
        for span, placeholder in spans:
            if bounds is None:
                bounds = inputs.positions.clone()
            row = q0 + span.row
            bounds[row : row + span.count] = placeholder.end - 1
    if bounds is None:
        return inputs
    meta = dataclasses.replace(inputs.metadata, visible_up_to=bounds)
    return dataclasses.replace(inputs, metadata=meta)


def mrope_positions(
    inputs: StepInputs, chunks: list[tuple[int, int, tuple[torch.Tensor, int] | None]]
) -> torch.Tensor:
    """The step's ``[3, T]`` multimodal rotary positions (Qwen2-VL family).

    Args:
        inputs: The step's inputs (``positions`` ``[T]``: each token's place in its sequence).
        chunks: ``(first row in the step, tokens, (prompt positions [3, P], delta) or None)``
            per sequence; None for a prompt without images (its positions are its places, in
            all three sections).

    Returns:
        ``[3, T]`` int64: a prompt token's own 3-D position, a later token's place plus the
        sequence's delta.
    """
    plain = inputs.positions
    out = plain.unsqueeze(0).expand(3, -1).clone()
    for q0, count, rope in chunks:
        if rope is None:
            continue
        table, delta = rope
        table = table.to(plain.device)
        places = plain[q0 : q0 + count]
        in_prompt = places < table.shape[1]
        from_table = table[:, places.clamp(max=table.shape[1] - 1)]
        out[:, q0 : q0 + count] = torch.where(in_prompt, from_table, places + delta)
    return out
