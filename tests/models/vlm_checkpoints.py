"""Tiny random vision-language checkpoints from transformers' real config and processor classes.

Each builder writes a directory that ``AutoModelForImageTextToText`` and ``AutoProcessor`` (or,
where the processor also wants a video processor, which needs torchvision, the engine's
image-only loader: ``engine.client.processing``) load: a tiny vision tower and a tiny text
decoder with random weights, and the architecture's own processor over a small byte-level BPE
tokenizer (``engine.models.tiny_tokenizer``) with the architecture's image tokens added. Image
sizes are tiny, so an image becomes tens to a few hundred placeholder tokens.

Weights are drawn for decisive greedy decoding (as ``engine.models.tiny_model`` does): matrices
with std ``1/sqrt(fan_in)``, embeddings with std 1, norms near 1, and a wide LM head, so the
top two logits are rarely close.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TOKENIZER_VOCAB = 480
TEXT = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
}
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def chat_template(image: str) -> str:
    """A chat template that iterates over content parts; an image part renders as ``image``."""
    return (
        "{{ bos_token }}{% for message in messages %}"
        "{% if message['content'] is string %}"
        "{% set parts = [{'type': 'text', 'text': message['content']}] %}"
        "{% else %}{% set parts = message['content'] %}{% endif %}"
        "{{ message['role'].upper() + ': ' }}"
        "{% for part in parts %}"
        "{% if part['type'] == 'image' %}{{ '" + image + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{{ '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
    )


def tokenizer(special: list[str], image: str, **named: str) -> Any:
    """The tiny BPE tokenizer plus ``special`` tokens (ids from ``TOKENIZER_VOCAB`` on).

    ``named`` become the tokenizer's extra special token attributes (``image_token=...``).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from loraplex.engine.models.tiny_tokenizer import train_tokenizer

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(train_tokenizer(TOKENIZER_VOCAB)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=chat_template(image),
        extra_special_tokens=named or None,
    )
    tok.add_special_tokens({"additional_special_tokens": special})
    return tok


def decisive_init(model: torch.nn.Module, seed: int = 0) -> None:
    """Redraw every parameter (see the module docstring); buffers are left as they are."""
    gen = torch.Generator().manual_seed(seed)
    out_emb = model.get_output_embeddings()
    in_emb = model.get_input_embeddings()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if out_emb is not None and p is out_emb.weight and p is not in_emb.weight:
                std = 2.0 * p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif p is in_emb.weight:  # Gemma scales embeddings by sqrt(hidden) itself
                std = p.shape[1] ** -0.5 if _norm_base(name, model) == 0.0 else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif p.dim() == 1:
                base = 0.0 if name.endswith("bias") else _norm_base(name, model)
                scale = 0.02 if name.endswith("bias") else 0.1
                p.copy_(base + scale * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) * fan_in**-0.5)


def _norm_base(name: str, model: torch.nn.Module) -> float:
    """1 for a norm's weight, 0 for Gemma's ``(1 + w)`` norms and other vectors."""
    gemma = "gemma" in type(model).__name__.lower()
    return 0.0 if gemma else 1.0


def _save(model: Any, processor: Any, directory: Path, seed: int) -> Path:
    from transformers import GenerationConfig

    decisive_init(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=3, do_sample=False
    )
    model.save_pretrained(str(directory))
    processor.save_pretrained(str(directory))
    processor.image_processor.save_pretrained(str(directory))
    return directory


def _llama(vocab: int, **extra: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                       **TEXT, **extra)  # fmt: skip


# ---------------------------------------------------------------------------------- builders
def llava_next(directory: Path, seed: int = 0) -> Path:
    """LLaVA-NeXT: CLIP 32x32 (16 patches + CLS), any-res grid up to 2x2 tiles, a Llama."""
    from transformers import (
        CLIPVisionConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextProcessor,
    )
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    pinpoints = [[32, 64], [64, 32], [64, 64]]
    tok = tokenizer(["<image>"], "<image>\\n")
    image_id = tok.convert_tokens_to_ids("<image>")
    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(
            size={"shortest_edge": 32},
            crop_size={"height": 32, "width": 32},
            image_grid_pinpoints=pinpoints,
        ),
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tok.chat_template,
    )
    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(image_size=32, patch_size=8, **VISION),
        text_config=_llama(len(tok)),
        image_grid_pinpoints=pinpoints,
        image_token_id=image_id,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    return _save(LlavaNextForConditionalGeneration(config), processor, directory, seed)


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "llava_next": llava_next,
}


def llava_onevision(directory: Path, seed: int = 0) -> Path:
    """LLaVA-OneVision: SigLIP 32x32 (16 patches, no CLS), any-res up to 2x2 tiles, a Qwen2.

    Its processor takes a video processor, so it is built images-only (torchvision-free).
    """
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionProcessor,
        Qwen2Config,
        SiglipVisionConfig,
    )
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from loraplex.engine.client.auto_processor import image_only_class

    pinpoints = [[32, 64], [64, 32], [64, 64]]
    tok = tokenizer(["<image>", "<video>"], "<image>\\n")
    processor = image_only_class(LlavaOnevisionProcessor)(
        image_processor=LlavaOnevisionImageProcessorPil(
            size={"height": 32, "width": 32}, image_grid_pinpoints=pinpoints
        ),
        tokenizer=tok,
        video_processor=None,
        num_image_tokens=16,
        vision_feature_select_strategy="full",
        chat_template=tok.chat_template,
    )
    text = {k: v for k, v in TEXT.items()}
    config = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(image_size=32, patch_size=8, **VISION),
        text_config=Qwen2Config(
            vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=3, **text
        ),  # fmt: skip
        image_grid_pinpoints=pinpoints,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )
    return _save(LlavaOnevisionForConditionalGeneration(config), processor, directory, seed)


BUILDERS["llava_onevision"] = llava_onevision


def _idefics_tokens() -> list[str]:
    rows = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    return ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", *rows]


def idefics3(directory: Path, seed: int = 0) -> Path:
    """Idefics3: SigLIP-style 32x32 tower (16 patches), pixel shuffle 2 (4 tokens a crop),
    image splitting into 32x32 crops of an image resized to at most 64 (up to 2x2 + global)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    tok = tokenizer(_idefics_tokens(), "<image>\\n")
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
        ),
        tokenizer=tok,
        image_seq_len=4,
        chat_template=tok.chat_template,
    )
    config = Idefics3Config(
        vision_config=Idefics3VisionConfig(image_size=32, patch_size=8, **VISION),
        text_config=_llama(len(tok)),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    return _save(Idefics3ForConditionalGeneration(config), processor, directory, seed)


def smolvlm(directory: Path, seed: int = 0) -> Path:
    """SmolVLM: Idefics3's design (pixel shuffle, image splitting) with its own processor.

    Its processor takes a video processor, so it is built images-only (torchvision-free).
    """
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMProcessor
    from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from loraplex.engine.client.auto_processor import image_only_class

    tok = tokenizer([*_idefics_tokens(), "<video>"], "<image>\\n")
    processor = image_only_class(SmolVLMProcessor)(
        image_processor=SmolVLMImageProcessorPil(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
        ),
        tokenizer=tok,
        video_processor=None,
        image_seq_len=4,
        chat_template=tok.chat_template,
    )
    config = SmolVLMConfig(
        vision_config=SmolVLMVisionConfig(image_size=32, patch_size=8, **VISION),
        text_config=_llama(len(tok)),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    return _save(SmolVLMForConditionalGeneration(config), processor, directory, seed)


BUILDERS["idefics3"] = idefics3
BUILDERS["smolvlm"] = smolvlm


def mistral3(directory: Path, seed: int = 0) -> Path:
    """Mistral 3: a Pixtral tower (2-D RoPE, images up to 64 px at 8 px patches), a 2x2 patch
    merger, rows of ``[IMG]`` closed by ``[IMG_BREAK]``, the last by ``[IMG_END]``; a Mistral."""
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
    )

    from loraplex.engine.client.auto_processor import processor_class

    PixtralProcessor = processor_class("PixtralProcessor")  # noqa: N806 (torchvision-free)

    tok = tokenizer(["[IMG]", "[IMG_BREAK]", "[IMG_END]"], "[IMG]")
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size=8),
        tokenizer=tok,
        patch_size=8,
        spatial_merge_size=2,
        chat_template=tok.chat_template,
    )
    vision = {**VISION, "head_dim": VISION["hidden_size"] // VISION["num_attention_heads"]}
    config = Mistral3Config(
        vision_config=PixtralVisionConfig(image_size=64, patch_size=8, **vision),
        text_config=MistralConfig(
            vocab_size=len(tok),
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
            sliding_window=None,
            **TEXT,
        ),  # fmt: skip
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    return _save(Mistral3ForConditionalGeneration(config), processor, directory, seed)


def gemma3(directory: Path, seed: int = 0) -> Path:
    """Gemma 3: SigLIP 32x32 (16 patches) average-pooled to 4 soft tokens between
    ``<start_of_image>`` and ``<end_of_image>``, attended bidirectionally; a Gemma 3 decoder
    with a sliding-window layer and a global one."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    boi, soft, eoi = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
    tok = tokenizer([boi, soft, eoi], boi, boi_token=boi, image_token=soft, eoi_token=eoi)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=tok,
        image_seq_length=4,
        chat_template=tok.chat_template,
    )
    text = {**TEXT, "num_hidden_layers": 2}
    config = Gemma3Config(
        text_config=Gemma3TextConfig(
            vocab_size=len(tok),
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            **text,
        ),  # fmt: skip
        vision_config=SiglipVisionConfig(image_size=32, patch_size=8, **VISION),
        mm_tokens_per_image=4,
        boi_token_index=tok.convert_tokens_to_ids(boi),
        eoi_token_index=tok.convert_tokens_to_ids(eoi),
        image_token_index=tok.convert_tokens_to_ids(soft),
        tie_word_embeddings=False,  # tied, greedy tiny models repeat their last token
    )
    return _save(Gemma3ForConditionalGeneration(config), processor, directory, seed)


BUILDERS["mistral3"] = mistral3
BUILDERS["gemma3"] = gemma3


def _qwen_vl_processor(processor_class: Any) -> tuple[Any, Any, dict[str, int]]:
    """Qwen2.5-VL's and Qwen3-VL's tiny images-only processor (8 px patches merged 2x2, at most
    64x64 pixels), its tokenizer, and the config's vision token ids."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from loraplex.engine.client.auto_processor import image_only_class

    start, pad, end = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
    tok = tokenizer([start, pad, end, "<|video_pad|>"], start + pad + end)
    processor = image_only_class(processor_class)(
        image_processor=Qwen2VLImageProcessorPil(
            patch_size=8,
            merge_size=2,
            temporal_patch_size=2,
            size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64},
        ),
        tokenizer=tok,
        video_processor=None,
        chat_template=tok.chat_template,
    )
    ids = {
        "image_token_id": tok.convert_tokens_to_ids(pad),
        "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tok.convert_tokens_to_ids(start),
        "vision_end_token_id": tok.convert_tokens_to_ids(end),
    }
    return tok, processor, ids


def qwen2_5_vl(directory: Path, seed: int = 0) -> Path:
    """Qwen2.5-VL: dynamic resolution (8 px patches merged 2x2, at most 64x64 pixels: up to 16
    tokens an image, ``image_grid_thw`` per image), window attention in the vision tower, and
    M-RoPE (3-D positions) in the decoder.

    Its processor takes a video processor, so it is built images-only (torchvision-free).
    """
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
    )
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLVisionConfig,
    )

    tok, processor, ids = _qwen_vl_processor(Qwen2_5_VLProcessor)
    text = {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                        "mrope_section": [2, 3, 3]}}  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=Qwen2_5_VLTextConfig(
            vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=3, **text
        ),  # fmt: skip
        vision_config=Qwen2_5_VLVisionConfig(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            patch_size=8,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=32,
            out_hidden_size=TEXT["hidden_size"],
            fullatt_block_indexes=[1],
        ),  # fmt: skip
        **ids,
    )
    return _save(Qwen2_5_VLForConditionalGeneration(config), processor, directory, seed)


BUILDERS["qwen2_5_vl"] = qwen2_5_vl


def qwen3_vl(directory: Path, seed: int = 0) -> Path:
    """Qwen3-VL: Qwen2.5-VL's dynamic resolution and M-RoPE (interleaved sections), learned
    vision position embeddings, and deepstack: features of two vision layers added to the image
    tokens' hidden states after the decoder's first two layers.

    Its processor takes a video processor, so it is built images-only (torchvision-free).
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen3_vl.configuration_qwen3_vl import (
        Qwen3VLTextConfig,
        Qwen3VLVisionConfig,
    )

    tok, processor, ids = _qwen_vl_processor(Qwen3VLProcessor)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
            "mrope_interleaved": True}  # fmt: skip
    config = Qwen3VLConfig(
        text_config=Qwen3VLTextConfig(
            vocab_size=len(tok),
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
            rope_parameters=rope,
            **TEXT,
        ),  # fmt: skip
        vision_config=Qwen3VLVisionConfig(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            patch_size=8,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=TEXT["hidden_size"],
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        ),
        **ids,
    )
    return _save(Qwen3VLForConditionalGeneration(config), processor, directory, seed)


BUILDERS["qwen3_vl"] = qwen3_vl
