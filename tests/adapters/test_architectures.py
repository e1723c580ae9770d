"""Adapters for architectures other than Llama: the targets come from the served model itself.

Phi-3 (fused ``qkv_proj`` / ``gate_up_proj``), Qwen3 and Gemma 2 text models, and three
vision-language models whose text decoder sits elsewhere (Gemma 3 and Qwen2.5-VL at
``model.language_model.layers``, Idefics3 at ``model.text_model.layers``). Adapters are made by
PEFT itself on tiny random models; validation sees only the config (built on the meta device).
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from loraplex.adapters.base_model import BaseModelInfo, model_targets
from loraplex.adapters.limits import AdapterLimits
from loraplex.adapters.store import AdapterStore
from loraplex.adapters.validation import load_adapter_dir
from tests.adapters.conftest import (
    LLAMA_PROJECTIONS,
    MAX_RANK,
    assert_refused,
    edit_config,
    edit_tensors,
    make_adapter,
)
from tests.adapters.test_accept import check_matches_peft

TEXT = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)
PHI3 = ("o_proj", "qkv_proj", "gate_up_proj", "down_proj")


def _config(arch: str):
    if arch == "phi3":
        return transformers.Phi3Config(**TEXT)
    if arch == "qwen3":
        return transformers.Qwen3Config(**TEXT, head_dim=8)
    if arch == "gemma2":
        return transformers.Gemma2Config(**TEXT, head_dim=8)
    if arch == "qwen3_moe":  # layer 0 a dense MLP, layer 1 fused experts (not nn.Linear)
        return transformers.Qwen3MoeConfig(
            **TEXT, head_dim=8, moe_intermediate_size=16, num_experts=4, mlp_only_layers=[0]
        )
    if arch == "gemma3":
        return transformers.Gemma3Config(
            text_config=dict(**TEXT, head_dim=8),
            vision_config=dict(**VISION, image_size=28, patch_size=14),
            mm_tokens_per_image=4,
        )
    if arch == "idefics3":
        return transformers.Idefics3Config(
            text_config=dict(model_type="llama", **TEXT),
            vision_config=dict(**VISION, image_size=28, patch_size=14),
            scale_factor=2,
        )
    assert arch == "qwen2_5_vl"
    vision = dict(hidden_size=32, intermediate_size=48, depth=1, num_heads=4, out_hidden_size=32)
    return transformers.Qwen2_5_VLConfig(text_config=dict(**TEXT), vision_config=vision)


TEXT_ARCHS = {"phi3": PHI3, "qwen3": LLAMA_PROJECTIONS, "gemma2": LLAMA_PROJECTIONS}
VLM_PREFIX = {
    "gemma3": "model.language_model.layers",
    "qwen2_5_vl": "model.language_model.layers",
    "idefics3": "model.text_model.layers",
}


ALL = sorted(TEXT_ARCHS) + sorted(VLM_PREFIX)


@functools.cache
def serve(arch: str):
    """``(arch, the random PEFT base model, validation's keyword arguments)``."""
    config = _config(arch)
    auto = AutoModelForImageTextToText if arch in VLM_PREFIX else AutoModelForCausalLM
    base = auto.from_config(config).eval()
    limits = AdapterLimits(targets=model_targets(config), max_rank=MAX_RANK)
    return arch, base, {"limits": limits, "info": BaseModelInfo(names=(arch,))}


@pytest.fixture
def store(tmp_path):
    return AdapterStore(tmp_path / "store")


def may_target(names) -> str:
    return re.escape("may target: " + ", ".join(names))


@pytest.mark.parametrize("arch", ALL)
def test_targets_are_every_linear_of_the_decoder_layers(arch):
    _, base, kw = serve(arch)
    targets = kw["limits"].targets
    modules = dict(base.named_modules())
    assert targets.architecture == type(base).__name__
    assert targets.layers_prefix == VLM_PREFIX.get(arch, "model.layers")
    assert targets.names == TEXT_ARCHS.get(arch, LLAMA_PROJECTIONS)
    for i in range(targets.num_layers):
        layer = modules[f"{targets.layers_prefix}.{i}"]
        linears = {p: m for p, m in layer.named_modules() if type(m).__name__ == "Linear"}
        assert [t.path for t in targets.layer(i)] == list(linears)
        for t in targets.layer(i):
            assert (t.in_features, t.out_features) == (
                linears[t.path].in_features,
                linears[t.path].out_features,
            )
    assert targets.multimodal is (arch in VLM_PREFIX)


def _cases(arch: str, names: tuple[str, ...], prefix: str) -> dict[str, dict]:
    fused = ["qkv_proj", "gate_up_proj"] if arch == "phi3" else ["q_proj", "v_proj", "up_proj"]
    regex = rf"{re.escape(prefix)}\.\d+\.(?:.*\.)?(?:{'|'.join(fused)})"
    cases = {
        "every target (decoder regex)": dict(r=4, lora_alpha=8),
        "some, regex": dict(r=8, lora_alpha=4, target_modules=regex),
        "patterns": dict(
            r=4,
            lora_alpha=8,
            # keys that never overlap: PEFT saves the config with sorted keys, so "first
            # matching key" is the saved order's
            rank_pattern={names[0]: 2, rf"{re.escape(prefix)}\.1\..*{names[-1]}": 8},
            alpha_pattern={names[-1]: 3},
            use_rslora=True,
        ),
    }
    if prefix == "model.layers":  # text-only: PEFT's usual list spellings reach no vision tower
        cases["list"] = dict(r=4, lora_alpha=8, target_modules=fused)
        cases["all-linear"] = dict(r=2, lora_alpha=2, target_modules="all-linear")
        cases["layers"] = dict(r=4, target_modules=fused, layers_to_transform=[1])
    return cases


@pytest.mark.parametrize("arch", ALL)
def test_peft_adapters_are_accepted_with_peft_targets_ranks_and_scales(arch, tmp_path):
    _, base, kw = serve(arch)
    targets = kw["limits"].targets
    for name, case in _cases(arch, targets.names, targets.layers_prefix).items():
        case.setdefault("target_modules", targets.peft_target_regex())
        out, state_dict, peft_model = make_adapter(base, tmp_path / name.replace(" ", "_"), **case)
        adapter = load_adapter_dir(out, **kw)
        check_matches_peft(adapter, state_dict, peft_model)
        assert set(adapter.target_modules) <= set(targets.names), name


@pytest.mark.parametrize("arch", ALL)
def test_embedding_and_head_targets_are_refused_with_what_may_be_targeted(arch, store, tmp_path):
    _, base, kw = serve(arch)
    names = kw["limits"].targets.names
    for i, (targets, part) in enumerate(
        ((["embed_tokens", names[0]], "token embedding"), (["lm_head"], "output head"))
    ):
        out, _, _ = make_adapter(base, tmp_path / str(i), r=4, target_modules=targets)
        assert_refused(store, out, kw, rf"\({part}\).*{may_target(names)}")


@pytest.mark.parametrize("arch", ALL)
def test_names_of_other_architectures_are_refused_with_the_served_names(arch, store, tmp_path):
    _, base, kw = serve(arch)
    targets = kw["limits"].targets
    names = targets.names
    own = [f"{targets.layers_prefix}.{i}.{targets.layer(i)[1].path}" for i in range(2)]
    out, _, _ = make_adapter(base, tmp_path / "own", r=4, target_modules=own)
    assert load_adapter_dir(out, **kw).target_modules == (names[1],)
    foreign = "q_proj" if arch == "phi3" else "qkv_proj"
    edit_config(out, target_modules=[foreign, *own])
    assert_refused(store, out, kw, rf"'{foreign}' matches no module .*{may_target(names)}")


VLM_REFUSED = {
    "gemma3": [
        (["q_proj", "v_proj"], r"model\.vision_tower\.\S+q_proj \(vision tower\)"),
        (r".*vision_tower.*\.fc1", r"fc1 \(vision tower\)"),
        ("all-linear", r"\(vision tower\)"),
    ],
    "idefics3": [
        (["q_proj", "v_proj"], r"model\.vision_model\.\S+q_proj \(vision tower\)"),
        (["modality_projection.proj"], r"model\.connector\.\S+ \(multimodal projector\)"),
        ("all-linear", r"\(vision tower\)"),
    ],
    "qwen2_5_vl": [
        (["qkv", "q_proj"], r"model\.visual\.blocks\.0\.attn\.qkv \(vision tower\)"),
        (["gate_proj"], r"model\.visual\.\S+gate_proj \(vision tower\)"),
        ("all-linear", r"\(vision tower\)"),
    ],
}


@pytest.mark.parametrize("arch", sorted(VLM_PREFIX))
def test_vision_targets_are_refused_with_what_may_be_targeted(arch, store, tmp_path):
    _, base, kw = serve(arch)
    names = kw["limits"].targets.names
    for i, (targets, match) in enumerate(VLM_REFUSED[arch]):
        out, _, _ = make_adapter(base, tmp_path / str(i), r=4, target_modules=targets)
        assert_refused(store, out, kw, rf"{match}.*{may_target(names)}")


@pytest.mark.parametrize("arch", sorted(VLM_PREFIX))
def test_text_only_layout_is_refused_on_a_vision_language_model(arch, store, tmp_path):
    """``model.layers.N`` tensors name a text-only model, not this VLM's decoder."""
    _, base, kw = serve(arch)
    prefix = kw["limits"].targets.layers_prefix
    out, _, _ = make_adapter(
        base, tmp_path / "a", r=4, target_modules=kw["limits"].targets.peft_target_regex()
    )
    old, new = f"base_model.model.{prefix}.", "base_model.model.model.layers."
    edit_tensors(out, lambda t: {k.replace(old, new): v for k, v in t.items()})
    assert_refused(store, out, kw, r"made for a text-only Llama or similar model .* served model")


@pytest.mark.parametrize("arch", ["gemma3", "idefics3"])
def test_legacy_layout_follows_transformers_conversion_mapping(arch, tmp_path):
    """Gemma 3 was renamed in transformers 4.52 like LLaVA (legacy names load); Idefics3 was not."""
    _, base, kw = serve(arch)
    targets = kw["limits"].targets
    regex = r".*(language_model|text_model).*\.(q_proj|v_proj)"  # either layout's decoder
    out, _, _ = make_adapter(base, tmp_path / "a", r=4, target_modules=regex)
    digest = load_adapter_dir(out, **kw).digest
    old = f"base_model.model.{targets.layers_prefix.removesuffix('layers')}"
    new = "base_model.model.language_model.model."
    edit_tensors(out, lambda t: {k.replace(old, new): v for k, v in t.items()})
    if arch == "gemma3":
        assert targets.legacy_layout
        assert load_adapter_dir(out, **kw).digest == digest
    else:
        assert not targets.legacy_layout
        with pytest.raises(ValueError, match="LLaVA or similar vision-language model saved by"):
            load_adapter_dir(out, **kw)


def test_moe_experts_are_not_targets(store, tmp_path):
    """Qwen3-MoE, layer 0 dense: attention adapters load; PEFT's fused-expert LoRA is refused."""
    _, base, kw = serve("qwen3_moe")
    targets = kw["limits"].targets
    assert [len(targets.layer(i)) for i in range(2)] == [7, 4]  # layer 1: attention only
    attention = targets.peft_target_regex(LLAMA_PROJECTIONS[:4])
    out, state_dict, peft_model = make_adapter(base, tmp_path / "a", r=4, target_modules=attention)
    check_matches_peft(load_adapter_dir(out, **kw), state_dict, peft_model)
    # PEFT turns MLP names into target_parameters on the experts' fused 3-D weights
    out, _, _ = make_adapter(base, tmp_path / "b", r=4, target_modules="all-linear")
    assert_refused(store, out, kw, "target_parameters .* fused expert weights")


def test_targets_differ_per_layer(store, tmp_path):
    """Layer 0's dense MLP can carry LoRA, layer 1 (experts) has none: shapes are per layer.

    Written by hand: PEFT itself redirects MLP names on this model to the experts (above).
    """
    from safetensors.torch import save_file

    _, _, kw = serve("qwen3_moe")
    targets = kw["limits"].targets
    out = tmp_path / "dense"
    out.mkdir()
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 2,
                "lora_alpha": 4,
                "target_modules": r"model\.layers\.0\.mlp\.(gate|up|down)_proj",
            }
        )
    )
    tensors = {}
    for t in targets.layer(0)[4:]:
        prefix = f"base_model.model.model.layers.0.{t.path}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(2, t.in_features)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(t.out_features, 2)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter = load_adapter_dir(out, **kw)
    assert sorted(adapter.weights) == [(0, "down_proj"), (0, "gate_proj"), (0, "up_proj")]
    assert adapter.weights[(0, "down_proj")][0].shape == (2, 48)  # A [r, intermediate_size]
    old, new = "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"
    edit_tensors(out, lambda t: {k.replace(old, new): v for k, v in t.items()})
    assert_refused(store, out, kw, rf"LoRA weights for {re.escape(new)}: .*may target")
