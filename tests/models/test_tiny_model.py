"""The built-in tiny model: deterministic, and a directory transformers loads and runs."""

from __future__ import annotations

import json

import pytest
import torch

from engine.tiny_model import IMAGE_ID, init_tiny, parameter_count


def test_same_seed_same_bytes_other_seed_differs(tmp_path, llava_dir, text_dir):
    again = init_tiny(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (
        llava_dir / "model.safetensors"
    ).read_bytes()
    for name in ("tokenizer.json", "config.json", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (llava_dir / name).read_bytes()
    other = init_tiny(tmp_path / "other", seed=1, text_only=True)
    assert (other / "model.safetensors").read_bytes() != (
        text_dir / "model.safetensors"
    ).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (text_dir / "tokenizer.json").read_bytes()


def test_config_values(llava_dir, text_dir):
    config = json.loads((llava_dir / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert config["image_token_index"] == IMAGE_ID
    assert config["vision_feature_layer"] == -2
    assert config["vision_feature_select_strategy"] == "default"
    text = config["text_config"]
    assert (text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]) == (
        64,
        4,
        2,
    )
    assert text["vocab_size"] == 1024
    assert json.loads((text_dir / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    assert parameter_count(text_dir) < parameter_count(llava_dir) < 500_000


def test_transformers_loads_and_generates_text_only(text_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(text_dir, output_loading_info=True)
    assert not any(info.values()), info
    batch = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Simple is better than complex."}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
    )  # fmt: skip
    text = tokenizer.decode(batch["input_ids"][0])
    assert text == "<s>USER: Simple is better than complex.\nASSISTANT:"
    out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > batch["input_ids"].shape[1]


def test_processor_expands_images_and_transformers_generates(llava_dir, processor, photos):
    from transformers import AutoModelForImageTextToText

    assert type(processor).__name__ == "LlavaProcessor"
    assert processor.patch_size == 8 and processor.vision_feature_select_strategy == "default"
    model, info = AutoModelForImageTextToText.from_pretrained(llava_dir, output_loading_info=True)
    assert not any(info.values()), info
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": photos[1]},
                {"type": "text", "text": "What is in this picture?"},
            ],
        }
    ]
    batch = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    ids = batch["input_ids"][0].tolist()
    assert ids.count(IMAGE_ID) == 64 == (64 // 8) ** 2
    assert batch["pixel_values"].shape == (1, 3, 64, 64)
    text = processor.tokenizer.decode([i for i in ids if i != IMAGE_ID])
    assert text == "<s>USER: \nWhat is in this picture?\nASSISTANT:"
    out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > len(ids)


def test_presets_and_overrides(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        init_tiny(tmp_path / "x", preset="huge")
    with pytest.raises(ValueError, match="cannot override"):
        init_tiny(tmp_path / "x", hidden_sizes=3)
    d = init_tiny(tmp_path / "wide", text_only=True, hidden_size=96, num_hidden_layers=1)
    config = json.loads((d / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (96, 1)


def test_bench_preset_size():
    from engine.tiny_model import TEXT_PRESETS, _text_config, _text_spec

    cfg = _text_config("bench", {})
    total = sum(torch.Size(shape).numel() for _, shape, _ in _text_spec(cfg, "model."))
    assert 25e6 < total < 35e6
    assert TEXT_PRESETS["bench"]["hidden_size"] == 512


def test_chat_templates_render_multi_turn(processor, tokenizer):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": "And now?"},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = (
        "<s>Be brief.\nUSER: <image>\nWhat?\nASSISTANT: A cat.</s>\nUSER: And now?\nASSISTANT:"
    )
    assert text == expected
    plain = [{**m, "content": "x"} for m in messages]
    text = tokenizer.apply_chat_template(plain, add_generation_prompt=False, tokenize=False)
    assert text == "<s>x\nUSER: x\nASSISTANT: x</s>\nUSER: x\n"


def test_reinit_as_text_only_removes_processor_files(tmp_path):
    d = init_tiny(tmp_path / "m", seed=3)
    assert (d / "processor_config.json").exists()
    init_tiny(d, seed=3, text_only=True)
    assert not (d / "processor_config.json").exists()
    assert not (d / "preprocessor_config.json").exists()
