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
        num_image_tokens: Placeholder tokens per image; 0 when it varies with the image (a
            transformers vision-language model).
        num_kv_blocks: Blocks in the KV pool.
        block_size: Tokens per block.
        max_image_span: Longest image span (first to last image token) allowed, None for no
            limit: a model that attends bidirectionally within an image computes each image
            in one step, so its span must fit the step's token budget.
    """

    max_model_len: int
    vocab_size: int
    image_token_id: int | None
    num_image_tokens: int
    num_kv_blocks: int
    block_size: int
    max_image_span: int | None = None


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
    """Check that every image's placeholder span is in the prompt and covers it exactly.

    A fixed-size model's runs (``num_image_tokens > 0``) are all image tokens, of the model's
    length; a variable one's spans start and end on an image token and come in prompt order
    without overlapping (other tokens may lie between their image tokens). Together they cover
    every image token of the prompt, and none is longer than ``max_image_span``.

    Raises:
        ValueError: a placeholder that does not match, or more images than placeholders (or
            the reverse).
    """
    image_token = limits.image_token_id
    ids = request.prompt_token_ids
    n_slots = sum(1 for t in ids if t == image_token) if image_token is not None else 0
    covered = 0
    previous_end = 0
    for i, image in enumerate(request.images):
        ph = image.placeholder
        if ph.end > len(ids) or (not limits.num_image_tokens and ph.offset < previous_end):
            raise ValueError(f"image {i}'s placeholder does not match the prompt's tokens")
        previous_end = ph.end
        span = ids[ph.offset : ph.end]
        if limits.num_image_tokens:
            if any(t != image_token for t in span):
                raise ValueError(f"image {i}'s placeholder does not match the prompt's tokens")
            if ph.length != limits.num_image_tokens:
                raise ValueError(
                    f"image {i} has {ph.length} placeholder tokens, the model "
                    f"needs {limits.num_image_tokens}"
                )
        elif span[0] != image_token or span[-1] != image_token:
            raise ValueError(f"image {i}'s placeholder does not match the prompt's tokens")
        if limits.max_image_span is not None and ph.length > limits.max_image_span:
            raise ValueError(
                f"image {i} spans {ph.length} tokens; this model computes an image in one step "
                f"of at most {limits.max_image_span} tokens (max_num_batched_tokens)"
            )
        covered += ph.length if limits.num_image_tokens else span.count(image_token)
    if covered != n_slots:
        raise ValueError(
            f"the prompt has {n_slots} image placeholder tokens but the "
            f"{len(request.images)} image(s) cover {covered}: more images than "
            "placeholders or the reverse"
        )
