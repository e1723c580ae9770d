"""Loading a model directory's tokenizer and processor (transformers' own classes)."""

from __future__ import annotations

import logging
from typing import Any

from loraplex.engine.client.inputs import InputProcessor

logger = logging.getLogger(__name__)


def load_processor(
    model_dir: str, model: Any, mm_hash: str, **image_bounds: float
) -> tuple[Any, InputProcessor]:
    """The tokenizer and the chat-message processor of a model directory.

    ``image_bounds`` are passed to :class:`InputProcessor` (``max_images``,
    ``max_image_pixels``, ``max_image_aspect_ratio``, ``max_request_image_pixels``).

    A multimodal model (one with ``image_token_id``) gets its processor
    (``engine.client.auto_processor``: ``AutoProcessor``, or images-only where its video
    processor needs the missing torchvision), a text-only one ``AutoTokenizer``. Image
    processors use transformers' PIL backend when torchvision is missing.

    Raises:
        ValueError: the directory has no usable tokenizer or processor.
    """
    from transformers import AutoTokenizer

    from loraplex.engine.client.auto_processor import load_auto_processor

    image_token_id = getattr(model, "image_token_id", None)
    try:
        if image_token_id is not None:
            processor = load_auto_processor(model_dir)
            tokenizer = processor.tokenizer
        else:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            processor = tokenizer
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot load the tokenizer/processor of {model_dir}: {exc}") from exc
    inputs = InputProcessor(
        processor,
        image_token_id=image_token_id,
        num_image_tokens=getattr(model, "num_image_tokens", 0),
        mm_hash=mm_hash,
        **image_bounds,
    )
    return tokenizer, inputs


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes of input text that one token of ``tokenizer`` can stand for.

    Each id of the vocabulary (added and special tokens included) is decoded alone; a
    byte-level token holding part of a character decodes to U+FFFD (3 bytes), which only
    overestimates. A tokenizer that normalizes its input (NFC, lowercasing) may turn more input
    bytes into one token than the token decodes to, so the bound is doubled for those. The
    gateway divides a prompt's text bytes by this to bound its token count from below.

    Returns:
        The bound in bytes (>= 1).
    """
    ids = [[i] for i in range(len(tokenizer))]
    texts = tokenizer.batch_decode(
        ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.normalizer is not None:
        longest *= 2
    return max(1, longest)
