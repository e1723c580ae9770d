"""The transformers backend (``--model-impl transformers``).

transformers' own modeling code over the engine's paged KV cache, block tables and LoRA
layers (docs/transformers_backend.md).
"""

from loraplex.engine.models.transformers_backend.attention import (
    ATTN_IMPLEMENTATION,
    paged_attention_forward,
)
from loraplex.engine.models.transformers_backend.loader import (
    load_transformers_model,
    model_class_of,
    supports,
)
from loraplex.engine.models.transformers_backend.model import TransformersForCausalLM
from loraplex.engine.models.transformers_backend.vision import TransformersForImageTextToText

__all__ = [
    "ATTN_IMPLEMENTATION",
    "TransformersForCausalLM",
    "TransformersForImageTextToText",
    "load_transformers_model",
    "model_class_of",
    "paged_attention_forward",
    "supports",
]
