"""The digest follows what the adapter computes, not how its files happen to be written."""

from __future__ import annotations

import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters.validation import load_adapter_dir
from tests.adapters.conftest import edit_config, edit_tensors, make_adapter

ATTN = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
LM_QV = dict(r=4, lora_alpha=16, target_modules=r".*language_model.*\.(q_proj|v_proj)")


def rename(old: str, new: str):
    return lambda tensors: {k.replace(old, new): v for k, v in tensors.items()}


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_same_adapter_same_digest(text_base, text_kw, tmp_path):
    a, _, _ = make_adapter(text_base, tmp_path / "a", seed=3, **ATTN)
    b, _, _ = make_adapter(text_base, tmp_path / "b", seed=3, **ATTN)
    assert load_adapter_dir(a, **text_kw).digest == load_adapter_dir(b, **text_kw).digest


def test_reserialized_adapter_keeps_its_digest(text_base, text_kw, tmp_path):
    a, _, _ = make_adapter(text_base, tmp_path / "a", **ATTN)
    digest = load_adapter_dir(a, **text_kw).digest
    resaved = copy(a, tmp_path / "r")
    weights = resaved / "adapter_model.safetensors"
    save_file(load_file(weights), weights, metadata={"format": "pt", "note": "re-saved"})
    assert weights.read_bytes() != (a / "adapter_model.safetensors").read_bytes()
    infix = edit_tensors(copy(a, tmp_path / "d"), rename("lora_A.", "lora_A.default."))
    spelled = edit_config(
        copy(a, tmp_path / "s"),
        target_modules=r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj",
        base_model_name_or_path="somewhere/else",
        inference_mode=False,
    )
    for other in (resaved, infix, spelled):
        assert load_adapter_dir(other, **text_kw).digest == digest


def test_llava_legacy_layout_has_the_same_digest(llava_base, llava_kw, tmp_path):
    a, state_dict, _ = make_adapter(llava_base, tmp_path / "a", **LM_QV)
    legacy = edit_tensors(
        copy(a, tmp_path / "legacy"),
        rename("model.model.language_model.", "model.language_model.model."),
    )
    new, old = load_adapter_dir(a, **llava_kw), load_adapter_dir(legacy, **llava_kw)
    assert new.digest == old.digest
    assert set(new.weights) == set(old.weights)
    for key, (a_new, b_new, s_new) in new.weights.items():
        a_old, b_old, s_old = old.weights[key]
        assert torch.equal(a_new, a_old) and torch.equal(b_new, b_old) and s_new == s_old


def test_any_change_changes_the_digest(text_base, text_kw, tmp_path):
    a, _, _ = make_adapter(text_base, tmp_path / "a", **ATTN)
    base = load_adapter_dir(a, **text_kw).digest

    def nudge(tensors):
        key = "base_model.model.model.layers.3.self_attn.o_proj.lora_B.weight"
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] += 1e-3
        return tensors

    nudged = edit_tensors(copy(a, tmp_path / "w"), nudge)
    half = edit_tensors(copy(a, tmp_path / "f16"), lambda t: {k: v.half() for k, v in t.items()})
    variants = {
        "weight": nudged,
        "alpha": edit_config(copy(a, tmp_path / "al"), lora_alpha=9),
        "rslora": edit_config(copy(a, tmp_path / "rs"), use_rslora=True),
        "alpha_pattern": edit_config(copy(a, tmp_path / "ap"), alpha_pattern={"k_proj": 4}),
        "dtype": half,
        "seed": make_adapter(text_base, tmp_path / "s", seed=1, **ATTN)[0],
    }
    digests = {name: load_adapter_dir(d, **text_kw).digest for name, d in variants.items()}
    assert all(re.fullmatch(r"[0-9a-f]{64}", d) for d in digests.values())
    assert len(set(digests.values()) | {base}) == len(variants) + 1, digests
