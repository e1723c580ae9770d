"""Bad adapters are refused with a message naming the problem, and the store is left unchanged."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

from loraplex.adapters.store import AdapterStore
from tests.adapters.conftest import assert_refused, edit_config, edit_tensors, make_adapter

# The slow tier: the fast tier (-m 'not slow and not service') must stay under two minutes.
pytestmark = pytest.mark.slow

ATTN = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
MLP = dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"])
LM_QV = dict(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)")


@pytest.fixture
def store(tmp_path, text_base, text_kw):
    """A store already holding one good adapter, so "unchanged" means something."""
    store = AdapterStore(tmp_path / "store")
    good, _, _ = make_adapter(text_base, tmp_path / "good", seed=99, **MLP)
    store.put_dir(good, **text_kw)
    return store


@pytest.fixture
def attn_dir(text_base, tmp_path):
    return make_adapter(text_base, tmp_path / "attn", **ATTN)[0]


def test_pickle_weights_directory(store, text_base, text_kw, tmp_path):
    out, _, _ = make_adapter(text_base, tmp_path / "pkl", safe=False, **ATTN)
    assert (out / "adapter_model.bin").exists()
    assert_refused(store, out, text_kw, "adapter_model.bin are a pickle file")


def test_pickle_weights_upload(store, attn_dir, text_kw):
    buffer = io.BytesIO()
    torch.save({"x": torch.zeros(2)}, buffer)
    config = (attn_dir / "adapter_config.json").read_bytes()
    assert_refused(store, (config, buffer.getvalue()), text_kw, "pickle")
    legacy = io.BytesIO()
    torch.save({"x": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
    assert_refused(store, (config, legacy.getvalue()), text_kw, "pickle")


def test_missing_files(store, attn_dir, text_kw, tmp_path):
    (attn_dir / "adapter_config.json").unlink()
    assert_refused(store, attn_dir, text_kw, "no adapter_config.json")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    assert_refused(store, tmp_path / "empty", text_kw, "no adapter_model.safetensors")
    assert_refused(store, tmp_path / "nowhere", text_kw, "does not exist")


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"r": 32}, "r = 32 exceeds the server's max LoRA rank 16"),
        ({"rank_pattern": {"q_proj": 17}}, r"rank_pattern\['q_proj'\] = 17 exceeds"),
        ({"r": 0}, "not a positive integer rank"),
        ({"lora_alpha": -1}, "lora_alpha = -1 is not a positive number"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported; only LORA"),
        ({"peft_type": "LOHA"}, "peft_type 'LOHA' is not supported"),
        ({"peft_type": "PROMPT_TUNING"}, "peft_type 'PROMPT_TUNING' is not supported"),
        ({"peft_type": None}, "no peft_type"),
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"bias": "lora_only"}, "bias='lora_only' is not supported"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"lora_bias": True}, "lora_bias"),
        ({"init_lora_weights": "pissa"}, "modified base weights"),
        ({"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "fc1"]}, "'fc1' matches no"),
        ({"target_modules": r"(.*)\1q_proj"}, "backreference .* linear-time"),
        ({"target_modules": "nothing"}, "targets no module"),
        ({"rank_pattern": {"(?=q)q_proj": 2}}, "rank_pattern pattern .* lookahead"),
        ({"exclude_modules": r"(?<=x)y"}, "exclude_modules pattern .* lookbehind"),
        ({"target_modules": r"(x{1000}){1000}"}, "repeats too much"),
        ({"target_modules": "x" * 1001}, "longer than 1000 characters"),
        ({"rank_pattern": {f"(a|b){i}": 1 for i in range(60)}}, "regex patterns weigh 4"),
        ({"rank_pattern": {f"m{i}": 1 for i in range(4097)}}, "4097 entries; at most 4096"),
        ({"layers_pattern": ["layers"] * 65, "layers_to_transform": [0]}, "more than 64"),
        ({"rank_pattern": {"q_proj": "8"}}, "not a positive integer rank"),
        ({"target_modules": r"model\.layers\.(\d"}, "not a valid regex"),
        ({"layers_pattern": 3}, "layers_pattern must be"),
        ({"target_modules": None}, "names no target_modules"),
        ({"layers_to_transform": [0]}, "layer 1 k_proj, which its config does not target"),
        ({"future_feature": {"on": True}}, "options this server does not know: future_feature"),
        ({"task_type": "NOT_A_TASK"}, "not a valid LoRA config"),
    ],
)
def test_bad_config(changes, match, store, attn_dir, text_kw):
    assert_refused(store, edit_config(attn_dir, **changes), text_kw, match)


def test_unknown_empty_option_is_ignored(store, attn_dir, text_kw):
    adapter = store.put_dir(edit_config(attn_dir, future_feature=None), **text_kw)
    assert store.has(adapter.digest)


def test_config_too_large_or_too_deep(store, attn_dir, text_kw):
    path = attn_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "padding": None, "notes": " " * 300_000}))
    assert_refused(store, attn_dir, text_kw, "bytes; at most 262144 are accepted")
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert_refused(store, attn_dir, text_kw, "nests too deeply")


def test_config_not_an_object(store, attn_dir, text_kw):
    (attn_dir / "adapter_config.json").write_text("[1, 2]")
    assert_refused(store, attn_dir, text_kw, "must be a JSON object")
    (attn_dir / "adapter_config.json").write_text("{not json")
    assert_refused(store, attn_dir, text_kw, "not valid JSON")


def test_rank_too_high_from_peft(store, text_base, text_kw, tmp_path):
    out, _, _ = make_adapter(text_base, tmp_path / "r32", r=32, target_modules=["q_proj"])
    assert_refused(store, out, text_kw, "exceeds the server's max LoRA rank 16")


def test_peft_dora_and_modules_to_save(store, text_base, text_kw, tmp_path):
    out, _, _ = make_adapter(text_base, tmp_path / "dora", use_dora=True, **ATTN)
    assert_refused(store, out, text_kw, "DoRA")
    out, _, _ = make_adapter(text_base, tmp_path / "mts", modules_to_save=["lm_head"], **ATTN)
    assert_refused(store, out, text_kw, "modules_to_save")
    out, _, _ = make_adapter(text_base, tmp_path / "bias", bias="all", **ATTN)
    assert_refused(store, out, text_kw, "bias='all'")


def test_wider_model_adapter(store, text_kw, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=96,
        intermediate_size=172,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    )
    wide = AutoModelForCausalLM.from_config(config)
    out, _, _ = make_adapter(wide, tmp_path / "wide", **ATTN)
    assert_refused(store, out, text_kw, r"has shape \[4, 96\], expected \[4, 64\]")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda k, v: v[:-1] if k.endswith("q_proj.lora_B.weight") else v, "expected"),
        (lambda k, v: v[:3] if "lora_A" in k else v[:, :3], r"shape \[3, 64\], expected \[4, 64\]"),
        (lambda k, v: v.reshape(-1) if "v_proj.lora_A" in k else v, "shape"),
        (lambda k, v: v.clone().fill_(float("nan")) if "o_proj" in k else v, "NaN"),
    ],
)
def test_edited_tensors(edit, match, store, attn_dir, text_kw):
    edit_tensors(attn_dir, lambda t: {k: edit(k, v) for k, v in t.items()})
    assert_refused(store, attn_dir, text_kw, match)


def rename(pattern: str, repl: str):
    return lambda t: {re.sub(pattern, repl, k): v for k, v in t.items()}


@pytest.mark.parametrize(
    "fn, match",
    [
        (rename(r"layers\.3\.", "layers.9."), "layer 9, the served model has 4 layers"),
        (
            lambda t: {k: v for k, v in t.items() if "layers.2.self_attn.k_proj.lora_B" not in k},
            "missing lora_B for model.layers.2.self_attn.k_proj",
        ),
        (
            lambda t: {k: v for k, v in t.items() if "layers.2.self_attn.k_proj" not in k},
            "no weights for targeted module model.layers.2.self_attn.k_proj",
        ),
        (
            lambda t: {
                **t,
                "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": t[
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
                ],
            },
            "layer 0 up_proj, which its config does not target",
        ),
        (
            lambda t: {
                **t,
                "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": (
                    torch.ones(64)
                ),
            },
            "DoRA magnitude vector",
        ),
        (
            lambda t: {
                **t,
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias": (torch.ones(64)),
            },
            "is a bias",
        ),
        (
            lambda t: {
                **t,
                "base_model.model.model.embed_tokens.lora_embedding_A": (torch.ones(4, 1024)),
            },
            "embedding LoRA",
        ),
        (lambda t: {**t, "something_else": torch.ones(1)}, "unexpected tensor something_else"),
        (rename(r"model\.model\.layers", "model.model.language_model.layers"), "made for a LLaVA"),
        (lambda t: {}, "adapter has no weights for targeted module"),
    ],
)
def test_bad_tensor_names(fn, match, store, attn_dir, text_kw):
    assert_refused(store, edit_tensors(attn_dir, fn), text_kw, match)


def test_text_adapter_on_llava(store, attn_dir, llava_kw):
    assert_refused(
        store, attn_dir, llava_kw, "made for a text-only Llama .* served model is a LLaVA"
    )


@pytest.mark.parametrize(
    "targets, match",
    [
        (
            ["q_proj", "k_proj", "v_proj", "o_proj"],
            r"model\.vision_tower\.\S+q_proj \(vision tower\)",
        ),
        (["fc1"], r"mlp\.fc1 \(vision tower\)"),
        ("all-linear", r"\(vision tower\)"),
        (r".*vision_tower.*\.q_proj", r"q_proj \(vision tower\)"),
        (["multi_modal_projector.linear_1"], r"linear_1 \(multimodal projector\)"),
        (["embed_tokens", "q_proj"], r"embed_tokens \(token embedding\)"),
    ],
)
def test_llava_unsupported_targets(targets, match, store, llava_base, llava_kw, tmp_path):
    out, _, _ = make_adapter(llava_base, tmp_path / "v", r=4, target_modules=targets)
    assert_refused(store, out, llava_kw, match)


@pytest.mark.parametrize(
    "targets, match",
    [
        (["embed_tokens", "q_proj"], r"embed_tokens \(token embedding\)"),
        (["lm_head"], r"lm_head \(output head\)"),
    ],
)
def test_text_unsupported_targets(targets, match, store, text_base, text_kw, tmp_path):
    out, _, _ = make_adapter(text_base, tmp_path / "e", r=4, target_modules=targets)
    assert_refused(store, out, text_kw, match)


def test_config_reaching_vision_tower_without_its_tensors(store, llava_base, llava_kw, tmp_path):
    """PEFT would wrap the tower's q_proj too; dropping its tensors does not hide that."""
    out, _, _ = make_adapter(llava_base, tmp_path / "q", r=4, target_modules=["q_proj"])
    edit_tensors(out, lambda t: {k: v for k, v in t.items() if "vision_tower" not in k})
    assert_refused(store, out, llava_kw, r"target_modules matches .*vision tower")


def test_truncated_and_lying_safetensors(store, attn_dir, text_kw):
    config = (attn_dir / "adapter_config.json").read_bytes()
    data = (attn_dir / "adapter_model.safetensors").read_bytes()
    assert_refused(store, (config, data[:-10]), text_kw, "truncated or corrupt")
    assert_refused(store, (config, data[:100]), text_kw, "truncated or corrupt")
    assert_refused(store, (config, data[:5]), text_kw, "truncated")
    assert_refused(store, (config, b""), text_kw, "truncated")
    (n,) = __import__("struct").unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 10**6, end + 10**6]  # points past the file
    lie = json.dumps(header).encode()
    forged = len(lie).to_bytes(8, "little") + lie + data[8 + n :]
    assert_refused(store, (config, forged), text_kw, "truncated or corrupt|overlaps|gap")
