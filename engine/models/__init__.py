"""Model definitions (Llama, Mistral, Qwen2, LLaVA) over the paged KV cache, and their loader.

Every model has the same step interface::

    hidden = model(input_ids, positions, kv_caches, meta, backend, inputs_embeds=None)  # [T, H]
    logits = model.compute_logits(hidden[rows])                                      # [N, V]

plus ``embed_tokens``, ``num_layers``, ``num_kv_heads``, ``head_dim``, ``hidden_size``,
``vocab_size``, ``dtype``; LLaVA adds ``encode_images``, ``image_token_id`` and
``num_image_tokens``.
"""

from loraplex.engine.models.config import DecoderConfig, VisionConfig
from loraplex.engine.models.llama import LlamaForCausalLM
from loraplex.engine.models.llava import LlavaForConditionalGeneration
from loraplex.engine.models.loader import load_config, load_model
from loraplex.engine.models.registry import SUPPORTED_ARCHITECTURES, architecture_of, is_multimodal

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DecoderConfig",
    "LlamaForCausalLM",
    "LlavaForConditionalGeneration",
    "VisionConfig",
    "architecture_of",
    "is_multimodal",
    "load_config",
    "load_model",
]
