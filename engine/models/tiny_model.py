"""The built-in tiny model, written as a Hugging Face directory ``transformers`` loads and runs.

A random-weight LLaVA (CLIP tower, projector, Llama decoder) or a text-only Llama.

Everything is made offline and deterministically: the tokenizer and chat templates of
:mod:`engine.models.tiny_tokenizer`, configs, processor files, and safetensors weights drawn
from a seeded generator (same seed, byte-identical weights).

The weights are initialized for *decisive* greedy decoding: embeddings with std 1 and projections
with std ``1/sqrt(fan_in)`` make every layer matter, and an ``lm_head`` with std
``2/sqrt(hidden)`` spreads the logits (std about 2), so the top two logits are rarely close and
token-for-token parity with ``transformers`` does not hinge on float32 summation order.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.models.tiny_tokenizer import (
    BOS_ID,
    DEFAULT_VOCAB_SIZE,
    EOS_ID,
    IMAGE_ID,
    LLAVA_CHAT_TEMPLATE,
    PAD_ID,
    SPECIAL_TOKENS,
    TEXT_CHAT_TEMPLATE,
    train_tokenizer,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "IMAGE_ID",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "PRESET_TOKENIZER_VOCAB",
    "TEXT_PRESETS",
    "VISION",
    "init_tiny",
    "parameter_count",
    "train_tokenizer",
]


TEXT_PRESETS: dict[str, dict[str, Any]] = {
    # The built-in model: small enough for exhaustive CPU tests.
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
    },
    # About 26M parameters, for throughput benchmarks (use with text_only=True).
    "bench": {
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
    },
    # The shape of the real SmolLM-135M checkpoint (HuggingFaceTB/SmolLM-135M's config.json),
    # random weights, for throughput benchmarks (use with text_only=True). Its 49152-entry
    # embedding is kept; the tokenizer is the built-in one (see PRESET_TOKENIZER_VOCAB).
    "smollm-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
    },
    # A Llama-3.2-1B-like shape with a 32k vocabulary (1.05B parameters), random weights, for
    # GPU benchmarks (use with text_only=True): 16 layers, hidden 2048, MLP 8192, GQA 32/8,
    # head_dim 64, tied embeddings (as Llama 3.2 1B; the random-weight model then repeats
    # itself, which bench.speculative's repeating workload relies on).
    "llama-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 32000,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
    },
}
# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M's config.json): SmolLM-135M's layers with 8192
# positions and rope theta 100000; random weights, for long-context benchmarks (bench.kv_tiers'
# 4k-token conversations).
TEXT_PRESETS["smollm2-135m"] = {
    **TEXT_PRESETS["smollm-135m"],
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
}
PRESET_TOKENIZER_VOCAB = {
    "smollm-135m": DEFAULT_VOCAB_SIZE,
    "smollm2-135m": DEFAULT_VOCAB_SIZE,
    "llama-1b": DEFAULT_VOCAB_SIZE,
}
"""Presets whose model vocabulary is larger than the tokenizer the built-in corpus can train:
the tokenizer gets this many entries and the embedding rows above it are never produced by
encoding (as in checkpoints whose embedding is padded past the tokenizer); they decode to
nothing. Benchmarks feed token ids, so every row is used."""
OVERRIDABLE = frozenset(TEXT_PRESETS["tiny"]) | {
    "vocab_size",
    "head_dim",
    "attention_bias",
    "mlp_bias",
    "tie_word_embeddings",
    "rope_parameters",
}
VISION = {
    "image_size": 64,
    "patch_size": 8,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
# Files an earlier init_tiny may have left that this one might not write.
_OWN_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _text_spec(cfg: dict[str, Any], prefix: str) -> list[tuple[str, tuple[int, ...], float]]:
    """``(name, shape, std)`` of a Llama decoder's tensors; std < 0 marks a norm weight."""
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_size = cfg["num_attention_heads"] * head_dim
    kv_size = cfg["num_key_value_heads"] * head_dim
    spec = [(f"{prefix}embed_tokens.weight", (vocab, hidden), 1.0)]
    linears = {
        "self_attn.q_proj": (q_size, hidden, cfg.get("attention_bias", False)),
        "self_attn.k_proj": (kv_size, hidden, cfg.get("attention_bias", False)),
        "self_attn.v_proj": (kv_size, hidden, cfg.get("attention_bias", False)),
        "self_attn.o_proj": (hidden, q_size, cfg.get("attention_bias", False)),
        "mlp.gate_proj": (inter, hidden, cfg.get("mlp_bias", False)),
        "mlp.up_proj": (inter, hidden, cfg.get("mlp_bias", False)),
        "mlp.down_proj": (hidden, inter, cfg.get("mlp_bias", False)),
    }
    for i in range(cfg["num_hidden_layers"]):
        layer = f"{prefix}layers.{i}."
        spec.append((layer + "input_layernorm.weight", (hidden,), -1.0))
        for name, (out_f, in_f, bias) in linears.items():
            spec.append((f"{layer}{name}.weight", (out_f, in_f), in_f**-0.5))
            if bias:
                spec.append((f"{layer}{name}.bias", (out_f,), 0.02))
        spec.append((layer + "post_attention_layernorm.weight", (hidden,), -1.0))
    spec.append((f"{prefix}norm.weight", (hidden,), -1.0))
    if not cfg.get("tie_word_embeddings", False):
        spec.append(("lm_head.weight", (vocab, hidden), 2.0 * hidden**-0.5))
    return spec


def _vision_spec(text_hidden: int) -> list[tuple[str, tuple[int, ...], float]]:
    """``(name, shape, std)`` of the CLIP tower and projector (transformers 4.52+ names)."""
    c, inter, p = VISION["hidden_size"], VISION["intermediate_size"], VISION["patch_size"]
    positions = (VISION["image_size"] // p) ** 2 + 1
    v = "model.vision_tower.vision_model."
    spec = [
        (v + "embeddings.class_embedding", (c,), 1.0),
        (v + "embeddings.patch_embedding.weight", (c, 3, p, p), (3 * p * p) ** -0.5),
        (v + "embeddings.position_embedding.weight", (positions, c), 0.5),
        (v + "pre_layrnorm.weight", (c,), -1.0),
        (v + "pre_layrnorm.bias", (c,), 0.02),
    ]
    for i in range(VISION["num_hidden_layers"]):
        layer = f"{v}encoder.layers.{i}."
        for name, (out_f, in_f) in {
            "self_attn.q_proj": (c, c),
            "self_attn.k_proj": (c, c),
            "self_attn.v_proj": (c, c),
            "self_attn.out_proj": (c, c),
            "mlp.fc1": (inter, c),
            "mlp.fc2": (c, inter),
        }.items():
            spec.append((f"{layer}{name}.weight", (out_f, in_f), in_f**-0.5))
            spec.append((f"{layer}{name}.bias", (out_f,), 0.02))
        for norm in ("layer_norm1", "layer_norm2"):
            spec.append((f"{layer}{norm}.weight", (c,), -1.0))
            spec.append((f"{layer}{norm}.bias", (c,), 0.02))
    spec += [(v + "post_layernorm.weight", (c,), -1.0), (v + "post_layernorm.bias", (c,), 0.02)]
    proj = "model.multi_modal_projector."
    spec += [
        (proj + "linear_1.weight", (text_hidden, c), c**-0.5),
        (proj + "linear_1.bias", (text_hidden,), 0.02),
        (proj + "linear_2.weight", (text_hidden, text_hidden), text_hidden**-0.5),
        (proj + "linear_2.bias", (text_hidden,), 0.02),
    ]
    return spec


def _weights(
    spec: list[tuple[str, tuple[int, ...], float]],
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Draw every tensor in ``spec`` order from one seeded CPU generator (norms: 1 + N(0, 0.1)).

    Drawn in float32 (the same values whatever ``dtype``), each tensor then cast to ``dtype``.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tensors = {}
    for name, shape, std in spec:
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        tensors[name] = ((1.0 + 0.1 * noise) if std < 0 else noise * std).to(dtype)
    return tensors


def _text_config(preset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    if preset not in TEXT_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(TEXT_PRESETS)}")
    unknown = set(overrides) - OVERRIDABLE
    if unknown:
        raise ValueError(f"cannot override {sorted(unknown)}; allowed: {sorted(OVERRIDABLE)}")
    cfg = {"vocab_size": DEFAULT_VOCAB_SIZE, **TEXT_PRESETS[preset], **overrides}
    cfg.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    return cfg


def _save_tokenizer_and_processor(
    directory: Path, vocab_size: int, max_length: int, text_only: bool
) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(train_tokenizer(vocab_size)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=max_length,
        chat_template=TEXT_CHAT_TEMPLATE if text_only else LLAVA_CHAT_TEMPLATE,
    )
    if text_only:
        tokenizer.save_pretrained(str(directory))
        return
    from transformers import LlavaProcessor

    try:  # transformers 5: the PIL backend (torchvision may be missing)
        from transformers.models.clip.image_processing_pil_clip import (
            CLIPImageProcessorPil as ImageProcessor,
        )
    except ImportError:  # transformers 4
        from transformers import CLIPImageProcessor as ImageProcessor

    size = VISION["image_size"]
    image_processor = ImageProcessor(
        size={"shortest_edge": size},
        crop_size={"height": size, "width": size},
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=VISION["patch_size"],
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, dropped by "default"
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(directory))
    # transformers 5 keeps the image processor inside processor_config.json; older readers
    # (and other servers) look for preprocessor_config.json.
    image_processor.save_pretrained(str(directory))


def init_tiny(
    directory: str | Path,
    *,
    seed: int = 0,
    text_only: bool = False,
    preset: str = "tiny",
    weights_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Write the built-in tiny model as a Hugging Face directory.

    Args:
        directory: Where to write (created if needed; the model files in it are replaced).
        seed: Seed of the weights (the tokenizer does not depend on it).
        text_only: A ``LlamaForCausalLM`` with a string-content chat template instead of the
            ``LlavaForConditionalGeneration`` (CLIP tower, image processor, image template).
        preset: ``"tiny"`` (hidden 64, 4 layers, GQA 4/2), ``"bench"`` (about 26M
            parameters: hidden 512, 8 layers, 8 heads, MLP 1376) or ``"smollm-135m"`` (the
            real SmolLM-135M's shape: 30 layers, hidden 576, MLP 1536, GQA 9/3, head_dim 64,
            vocab 49152, tied embeddings; 134.5M parameters) or ``"llama-1b"`` (16 layers,
            hidden 2048, MLP 8192, GQA 32/8, head_dim 64, vocab 32000, tied embeddings;
            1.05B parameters, for GPU benchmarks).
        weights_dtype: The dtype the weights are saved in (drawn in float32, then cast;
            ``config.json``'s ``dtype`` says it, when not float32). bfloat16 halves a large
            preset's file.
        **overrides: LlamaConfig values replacing the preset's (see ``OVERRIDABLE``);
            ``vocab_size`` retrains the tokenizer to that size.

    Returns:
        The directory.
    """
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in _OWN_FILES:  # e.g. processor files of an earlier LLaVA init
        (directory / stale).unlink(missing_ok=True)
    cfg = _text_config(preset, overrides)
    text_config = LlamaConfig(**cfg)
    if text_only:
        config = text_config
        config.architectures = ["LlamaForCausalLM"]
        spec = _text_spec(cfg, "model.")
    else:
        num_image_tokens = (VISION["image_size"] // VISION["patch_size"]) ** 2
        config = LlavaConfig(
            text_config=text_config,
            vision_config=CLIPVisionConfig(**VISION),
            image_token_id=IMAGE_ID,
            image_seq_length=num_image_tokens,
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
            projector_hidden_act="gelu",
            multimodal_projector_bias=True,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        )
        config.architectures = ["LlavaForConditionalGeneration"]
        spec = _text_spec(cfg, "model.language_model.") + _vision_spec(cfg["hidden_size"])
    if weights_dtype != torch.float32:  # float32 files keep the config they always had
        config.dtype = weights_dtype
    config.save_pretrained(str(directory))
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(
        str(directory)
    )
    save_file(
        _weights(spec, seed, weights_dtype),
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    tokenizer_vocab = cfg["vocab_size"]
    if preset in PRESET_TOKENIZER_VOCAB and "vocab_size" not in overrides:
        tokenizer_vocab = PRESET_TOKENIZER_VOCAB[preset]
    _save_tokenizer_and_processor(
        directory, tokenizer_vocab, cfg["max_position_embeddings"], text_only
    )
    return directory


def parameter_count(directory: str | Path) -> int:
    """Elements in a model directory's ``model.safetensors`` (for reports)."""
    from safetensors import safe_open

    with safe_open(str(Path(directory) / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
