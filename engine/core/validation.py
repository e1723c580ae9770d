"""The one place an engine request is checked before it may run.

Everything a request carries is checked against the served model here, whoever calls it (the
engine core on ``add_request``, so the offline ``LLM`` and every client get the same answer):
sampling params, an empty or too long prompt, token ids outside the vocabulary, images that do
not match the prompt's placeholder tokens, and a prompt the KV pool could not hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.request import EngineRequest


@dataclass(frozen=True)
class RequestLimits:
    """What requests are checked against.

    Attributes:
        max_model_len: Most tokens of one sequence (prompt + output).
        vocab_size: Token ids are in ``[0, vocab_size)``.
        image_token_id: The image placeholder token, None for a text-only model.
        num_image_tokens: Placeholder tokens per image.
        num_kv_blocks: Blocks in the KV pool.
        block_size: Tokens per block.
    """

    max_model_len: int
    vocab_size: int
    image_token_id: int | None
    num_image_tokens: int
    num_kv_blocks: int
    block_size: int


def validate_request(request: EngineRequest, limits: RequestLimits) -> None:
    """Check a request against the model.

    Raises:
        ValueError: bad sampling parameters, an empty or too long prompt, token ids outside
            the vocabulary, images that do not match the placeholders, or a prompt the pool
            cannot hold.
    """
    request.sampling.validate()
    n_prompt = len(request.prompt_token_ids)
    if n_prompt == 0:
        raise ValueError("the prompt is empty")
    if n_prompt >= limits.max_model_len:
        raise ValueError(
            f"the prompt is {n_prompt} tokens; this model allows at most "
            f"{limits.max_model_len - 1} prompt tokens (max_model_len {limits.max_model_len})"
        )
    vocab = limits.vocab_size
    if any(not 0 <= t < vocab for t in request.prompt_token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    sampling = request.sampling
    if any(t >= vocab for t in sampling.stop_token_ids):
        raise ValueError(f"stop_token_ids must be in [0, {vocab})")
    if sampling.logit_bias and any(t >= vocab for t in sampling.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
    check_images(request, limits)
    blocks_needed = -(-min(n_prompt + 1, limits.max_model_len) // limits.block_size)
    if blocks_needed > limits.num_kv_blocks:
        raise ValueError(
            f"the prompt needs {blocks_needed} KV blocks; the pool has {limits.num_kv_blocks}"
        )


def check_images(request: EngineRequest, limits: RequestLimits) -> None:
    """Check that every image's placeholder run is in the prompt and covers it exactly.

    Each run has the model's length, and together they cover every placeholder token.

    Raises:
        ValueError: a placeholder that does not match, or more images than placeholders (or
            the reverse).
    """
    image_token = limits.image_token_id
    ids = request.prompt_token_ids
    n_slots = sum(1 for t in ids if t == image_token) if image_token is not None else 0
    covered = 0
    for i, image in enumerate(request.images):
        ph = image.placeholder
        if ph.end > len(ids) or any(t != image_token for t in ids[ph.offset : ph.end]):
            raise ValueError(f"image {i}'s placeholder does not match the prompt's tokens")
        if ph.length != limits.num_image_tokens:
            raise ValueError(
                f"image {i} has {ph.length} placeholder tokens, the model "
                f"needs {limits.num_image_tokens}"
            )
        covered += ph.length
    if covered != n_slots:
        raise ValueError(
            f"the prompt has {n_slots} image placeholder tokens but the "
            f"{len(request.images)} image(s) cover {covered}: more images than "
            "placeholders or the reverse"
        )
