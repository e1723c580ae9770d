"""Loader: shards, every LLaVA key layout, dtype, and clear errors for broken directories.

Loading onto the test device and a forward there are checked with ``ours_llava`` (on the test
device); the file-format checks load on the CPU and compare weights there.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine.models import SUPPORTED_ARCHITECTURES, load_model
from loraplex.engine.models.loader import engine_name


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same_weights(a, b):
    """Same names and bit-identical values (compared on the CPU: either may be on the device)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key].cpu(), sb[key].cpu()), key


def _rewrite(directory, rename):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    save_file({rename(k): v for k, v in tensors.items()}, path, metadata={"format": "pt"})


def test_loads_every_parameter_with_real_values(ours_llava, test_device):
    for name, tensor in ours_llava.state_dict().items():
        assert tensor.device.type == test_device.type and not tensor.isnan().any(), name
    norm = ours_llava.language_model.model.layers[0].input_layernorm.weight
    assert not torch.equal(norm, torch.ones_like(norm))  # tiny's norms are randomized


def test_sharded_checkpoint(tmp_path, llava_dir, ours_llava):
    d = _copy(llava_dir, tmp_path / "sharded")
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, shard))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    model, _ = load_model(d, torch.float32, "cpu")
    _assert_same_weights(model, ours_llava)
    # A shard the index names must exist.
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_model(d, torch.float32, "cpu")


def _legacy(name):
    """transformers <4.52 / llava-hf hub layout."""
    for old, new in (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    raise AssertionError(name)


def _transformers5_saved(name):
    """What transformers 5 save_pretrained writes: legacy prefixes, no vision_model."""
    return _legacy(name).replace("vision_tower.vision_model.", "vision_tower.")


@pytest.mark.parametrize("rename", [_legacy, _transformers5_saved])
def test_llava_key_layouts_load_identically(tmp_path, llava_dir, ours_llava, rename):
    d = _copy(llava_dir, tmp_path / "layout")
    _rewrite(d, rename)
    model, _ = load_model(d, torch.float32, "cpu")
    _assert_same_weights(model, ours_llava)


def test_transformers_own_save_loads(tmp_path, hf_llava, ours_llava):
    hf_llava.save_pretrained(tmp_path, safe_serialization=True)
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    _assert_same_weights(model, ours_llava)


def test_engine_names():
    assert engine_name("model.language_model.layers.0.mlp.up_proj.weight", True) == (
        "language_model.model.layers.0.mlp.up_proj.weight"
    )
    assert (
        engine_name("vision_tower.vision_model.pre_layrnorm.bias", True)
        == "vision_tower.pre_layrnorm.bias"
    )
    assert engine_name("lm_head.weight", False) == "lm_head.weight"


def test_dtype_and_ignorable_keys(tmp_path, text_dir):
    d = _copy(text_dir, tmp_path / "bf16")
    _rewrite_add(d, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    model, _ = load_model(d, torch.bfloat16, "cpu")
    assert model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())


def _rewrite_add(directory, extra):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    tensors.update(extra)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_directory_and_config(tmp_path, text_dir):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model(tmp_path / "nope", torch.float32, "cpu")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        load_model(tmp_path / "file", torch.float32, "cpu")
    d = _copy(text_dir, tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(d, torch.float32, "cpu")


def test_pickle_only_weights_refused(tmp_path, text_dir):
    d = _copy(text_dir, tmp_path / "bin")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"only pickle weights \(pytorch_model.bin\)"):
        load_model(d, torch.float32, "cpu")
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match="no model weights"):
        load_model(d, torch.float32, "cpu")


def test_unsupported_architecture(tmp_path, text_dir):
    d = _copy(text_dir, tmp_path / "gpt2")
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no native model for 'GPT2LMHeadModel'"):
        load_model(d, torch.float32, "cpu", "native")
    # auto: no native model, and transformers' model for the config's type is not GPT-2's
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not the causal-LM model"):
        load_model(d, torch.float32, "cpu")
    assert "LlavaForConditionalGeneration" in SUPPORTED_ARCHITECTURES


def test_missing_unexpected_and_misshaped_tensors(tmp_path, text_dir):
    d = _copy(text_dir, tmp_path / "missing")
    _rewrite(d, lambda k: k.replace("layers.1.mlp.up_proj", "layers.1.mlp.upp_proj"))
    with pytest.raises(
        ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        load_model(d, torch.float32, "cpu")
    d = _copy(text_dir, tmp_path / "unexpected")
    _rewrite_add(d, {"model.layers.0.extra.weight": torch.ones(2)})
    with pytest.raises(
        ValueError, match=r"unexpected tensors in checkpoint: model\.layers\.0\.extra"
    ):
        load_model(d, torch.float32, "cpu")
    d = _copy(text_dir, tmp_path / "shape")
    _rewrite_add(d, {"model.norm.weight": torch.ones(3)})
    with pytest.raises(
        ValueError, match=r"'model\.norm\.weight' has shape \(3,\), expected \(64,\)"
    ):
        load_model(d, torch.float32, "cpu")


@torch.no_grad()
def test_bfloat16_forward_tracks_float32(llava_dir, ours_llava, processor, photos, test_device):
    from tests.models.harness import BlockAllocator, Seq, make_kv_caches, run_step, splice_images

    batch = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": photos[0]}]}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
    )  # fmt: skip
    ids = batch["input_ids"][0]
    logits = {}
    for dtype, model in (
        (torch.bfloat16, load_model(llava_dir, torch.bfloat16, test_device)[0]),
        (torch.float32, ours_llava),
    ):
        embeds = splice_images(model, ids, batch["pixel_values"])
        assert embeds.dtype == dtype
        kv = make_kv_caches(model, 16, 16, dtype=dtype)
        (hidden,) = run_step(
            model, kv, [(Seq(ids.tolist(), embeds), len(ids))], 16, BlockAllocator(16)
        )
        logits[dtype] = model.compute_logits(hidden).cpu()
        assert logits[dtype].dtype == torch.float32
    low, ref = logits[torch.bfloat16], logits[torch.float32]
    assert torch.isfinite(low).all()
    assert torch.corrcoef(torch.stack([low.flatten(), ref.flatten()]))[0, 1] > 0.99
