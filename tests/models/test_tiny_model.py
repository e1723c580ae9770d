"""The built-in tiny model: deterministic, and a directory transformers loads and runs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loraplex.engine.models import tiny_tokenizer
from loraplex.engine.models.tiny_model import IMAGE_ID, SPECIAL_TOKENS, init_tiny, parameter_count
from loraplex.engine.models.tiny_tokenizer import corpus, train_tokenizer

# Pins of the built-in tokenizer: ``init-tiny --seed N`` must write the same tokenizer.json on
# every Python and library version. If a test below fails after an upgrade, the upgrade changed
# the tokenizer: find out why (and pin the library) rather than update these. Change them only
# when the corpus or the trainer's settings are changed on purpose.
CORPUS_SHA256 = "57c7334941fec6bec9be2753ab56f80251f498a4901841433a61ec246146daa3"
VOCAB_MERGES_SHA256 = "0ee981e48a81395a83e018809bdcd36433b23befd8d676e60f7abdc38b623e34"


def sha256_of_corpus(parts):
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def sha256_of_vocab_and_merges(tokenizer_json):
    model = json.loads(tokenizer_json)["model"]
    # tokenizers >= 0.20 writes a merge as a pair, older versions as "a b".
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    blob = json.dumps({"vocab": model["vocab"], "merges": merges}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


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
    from loraplex.engine.models.tiny_model import TEXT_PRESETS, _text_config, _text_spec

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


def test_corpus_is_pinned_and_needs_no_docstrings():
    assert sha256_of_corpus(corpus()) == CORPUS_SHA256
    # An isolated interpreter (-I: no environment, user site or cwd; a random hash seed) with
    # docstrings stripped (-OO) makes the same corpus: it reads no docstrings, no set order.
    code = (
        "import hashlib, importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('tt', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print(hashlib.sha256('\\x00'.join(module.corpus()).encode()).hexdigest())\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-OO", "-c", code, str(Path(tiny_tokenizer.__file__))],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == CORPUS_SHA256


def test_tokenizer_is_pinned(llava_dir, text_dir):
    assert sha256_of_vocab_and_merges(train_tokenizer()) == VOCAB_MERGES_SHA256
    for directory in (llava_dir, text_dir):
        written = (directory / "tokenizer.json").read_text()
        assert sha256_of_vocab_and_merges(written) == VOCAB_MERGES_SHA256
        added = {t["content"]: t["id"] for t in json.loads(written)["added_tokens"]}
        assert added == {token: i for i, token in enumerate(SPECIAL_TOKENS)}


def test_tokenizer_covers_the_test_text_and_multibyte_characters(tokenizer):
    vocab = tokenizer.get_vocab()
    assert len(vocab) == 1024
    assert {"USER", "ASSISTANT"} <= set(vocab)
    # The engine tests' filler words (tests/engine/conftest.py::long_text) are one or two tokens.
    words = (
        "the cat sat on a warm mat while the quick brown fox jumped over lazy dogs and "
        "small birds sang songs about rivers mountains stars cities bread honey"
    ).split()
    counts = [len(tokenizer.encode(" " + w, add_special_tokens=False)) for w in words]
    assert max(counts) <= 2 and sum(counts) <= 1.25 * len(words)
    text = "Café naïve Straße Ωμέγα Москва 日本語 東京 안녕하세요 😀 🐱 👩‍💻 🇫🇷 ok!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
