"""Adapters made by PEFT itself are accepted with PEFT's ranks, scales, targets and weights."""

from __future__ import annotations

import re

import pytest
import torch
from peft.tuners.lora import LoraLayer

from loraplex.adapters.base_model import model_targets
from loraplex.adapters.validation import load_adapter_dir
from tests.adapters.conftest import LLAMA_PROJECTIONS as PROJECTIONS
from tests.adapters.conftest import make_adapter

_MODULE = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)")

TEXT_CASES = {
    "attention": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all": dict(r=2, lora_alpha=4, target_modules=list(PROJECTIONS)),
    "all_linear": dict(r=4, lora_alpha=4, target_modules="all-linear"),
    "regex": dict(r=4, lora_alpha=8, target_modules=r".*\.layers\.[12]\.mlp\.(gate|down)_proj"),
    "patterns": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"q_proj": 8, r"layers\.1\.self_attn\.v_proj": 2},
        alpha_pattern={"v_proj": 32, "down_proj": 3},
    ),
    "rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "layers": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "up_proj"],
        layers_to_transform=[0, 2],
        layers_pattern="layers",
    ),
    "exclude": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], exclude_modules=r".*layers\.3\..*"
    ),
}
LLAVA_CASES = {
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "regex_lm": dict(r=4, lora_alpha=16, target_modules=r".*language_model.*\.(q_proj|v_proj)"),
    "regex_lm_all": dict(
        r=8,
        lora_alpha=8,
        use_rslora=True,
        target_modules=r".*language_model\.layers\.\d+\.(self_attn|mlp)\.[a-z]+_proj",
        rank_pattern={"o_proj": 2},
        alpha_pattern={"down_proj": 4},
    ),
}


def module_key(name: str) -> tuple[int, str]:
    match = _MODULE.search(name)
    assert match, name
    return int(match[1]), match[2]


def check_matches_peft(adapter, state_dict, peft_model):
    """Targets, ranks, scales, weights and the delta itself agree with PEFT's model."""
    layers = {
        module_key(name): module
        for name, module in peft_model.named_modules()
        if isinstance(module, LoraLayer)
    }
    assert set(adapter.weights) == set(layers)
    assert adapter.target_modules == tuple(sorted({p for _, p in layers}))
    assert adapter.rank == max(m.r["default"] for m in layers.values())
    for key, (a, b, scale) in adapter.weights.items():
        module = layers[key]
        assert a.dtype == b.dtype == torch.float32
        assert a.shape == (module.r["default"], module.in_features)
        assert b.shape == (module.out_features, module.r["default"])
        assert scale == pytest.approx(module.scaling["default"], rel=1e-12)
        names = [k for k in state_dict if module_key(k) == key]
        sd_a = next(state_dict[k] for k in names if "lora_A" in k)
        sd_b = next(state_dict[k] for k in names if "lora_B" in k)
        torch.testing.assert_close(a, sd_a, rtol=0, atol=0)
        torch.testing.assert_close(b, sd_b, rtol=0, atol=0)
        x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            delta = module(x) - module.base_layer(x)
        torch.testing.assert_close(delta, scale * (x @ a.T) @ b.T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", sorted(TEXT_CASES))
def test_text_adapters_match_peft(case, text_base, text_kw, tmp_path):
    kwargs = TEXT_CASES[case]
    out, state_dict, peft_model = make_adapter(text_base, tmp_path / case, **kwargs)
    adapter = load_adapter_dir(out, **text_kw)
    check_matches_peft(adapter, state_dict, peft_model)
    assert adapter.lora_alpha == kwargs["lora_alpha"]
    assert adapter.use_rslora is kwargs.get("use_rslora", False)
    assert re.fullmatch(r"[0-9a-f]{64}", adapter.digest)
    assert adapter.num_bytes == sum(a.nbytes + b.nbytes for a, b, _ in adapter.weights.values())


@pytest.mark.parametrize("case", sorted(LLAVA_CASES))
def test_llava_adapters_match_peft(case, llava_base, llava_kw, tmp_path):
    out, state_dict, peft_model = make_adapter(llava_base, tmp_path / case, **LLAVA_CASES[case])
    check_matches_peft(load_adapter_dir(out, **llava_kw), state_dict, peft_model)


def test_patterns_give_per_module_rank_and_scale(text_base, text_kw, tmp_path):
    out, _, _ = make_adapter(text_base, tmp_path / "p", **TEXT_CASES["patterns"])
    weights = load_adapter_dir(out, **text_kw).weights
    a, _, scale = weights[(0, "q_proj")]
    assert (a.shape[0], scale) == (8, 8 / 8)
    assert (weights[(1, "v_proj")][0].shape[0], weights[(1, "v_proj")][2]) == (2, 32 / 2)
    assert (weights[(2, "v_proj")][0].shape[0], weights[(2, "v_proj")][2]) == (4, 32 / 4)
    assert weights[(3, "down_proj")][2] == 3 / 4


def test_rslora_scale(text_base, text_kw, tmp_path):
    out, _, _ = make_adapter(text_base, tmp_path / "rs", **TEXT_CASES["rslora"])
    adapter = load_adapter_dir(out, **text_kw)
    assert {s for _, _, s in adapter.weights.values()} == {8 / 16**0.5}


def test_without_model_info(text_base, llava_base, text_kw, llava_kw, tmp_path):
    """The engine passes only its targets (no names); PEFT adapters still load the same."""
    for base, kw, case in ((text_base, text_kw, "attention"), (llava_base, llava_kw, "regex_lm")):
        cases = TEXT_CASES if base is text_base else LLAVA_CASES
        out, _, _ = make_adapter(base, tmp_path / case, **cases[case])
        plain = {k: v for k, v in kw.items() if k != "info"}
        assert load_adapter_dir(out, **plain).digest == load_adapter_dir(out, **kw).digest


def test_bf16_weights_are_loaded_as_float32(text_base, text_kw, tmp_path):
    out, state_dict, _ = make_adapter(text_base, tmp_path / "bf", **TEXT_CASES["attention"])
    from tests.adapters.conftest import edit_tensors

    edit_tensors(out, lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()})
    adapter = load_adapter_dir(out, **text_kw)
    a, _, _ = adapter.weights[(0, "q_proj")]
    key = next(k for k in state_dict if "layers.0.self_attn.q_proj.lora_A" in k)
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, state_dict[key].to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["native", "transformers"])
@pytest.mark.parametrize("which", ["text", "llava"])
def test_target_shapes_agree_with_engine_models(which, impl, text_dir, llava_dir):
    """From the config alone (meta device) validation reaches the engine models' targets."""
    from transformers import AutoConfig

    from loraplex.engine.models import load_model

    model_dir = text_dir if which == "text" else llava_dir
    model = load_model(model_dir, torch.float32, "cpu", impl)[0]
    engine = {(i, name): (m.in_features, m.out_features) for i, name, m in model.lora_targets()}
    targets = model_targets(AutoConfig.from_pretrained(model_dir))
    assert targets.shapes() == engine
    assert targets.names == PROJECTIONS
    prefix = "model.language_model.layers" if which == "llava" else "model.layers"
    assert targets.layers_prefix == prefix


def test_base_model_recorded_and_compared(text_base, text_kw, text_dir, tmp_path):
    out, _, _ = make_adapter(text_base, tmp_path / "a", **TEXT_CASES["attention"])
    from tests.adapters.conftest import edit_config

    adapter = load_adapter_dir(out, **text_kw)
    assert (adapter.base_model, adapter.base_model_match) == (str(text_dir), True)
    digest = adapter.digest
    for name, match in (("", None), ("org/tiny", True), ("llava-hf/other", False)):
        adapter = load_adapter_dir(edit_config(out, base_model_name_or_path=name), **text_kw)
        assert (adapter.base_model, adapter.base_model_match) == (name or None, match)
        assert adapter.digest == digest  # recorded, not part of what the adapter computes
