"""``--dtype auto``: the checkpoint's own dtype, resolved at load time, seen by all the sizing."""

import shutil

import pytest
import torch
from transformers import LlamaConfig, LlavaConfig

from loraplex.engine.config import EngineConfig
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.models.dtypes import checkpoint_dtype
from loraplex.engine.runner.loading import load_engine_model
from loraplex.engine.runner.model_runner import kv_block_bytes


@pytest.fixture(scope="module")
def bf16_dir(text_dir, tmp_path_factory):
    """The tiny Llama saved by transformers in bfloat16 (config.json's dtype: bfloat16)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("bf16") / "tiny-bf16"
    AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(text_dir / name, out / name)
    return out


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (LlamaConfig(dtype="bfloat16"), "bfloat16"),
        (LlamaConfig(dtype="float16"), "float16"),
        (LlamaConfig(dtype="float32"), "float32"),
        (LlamaConfig(dtype="float64"), "float32"),  # not an engine dtype: what every value fits
        (LlamaConfig(), "float32"),  # none saved
        (LlavaConfig(text_config=LlamaConfig(dtype="bfloat16")), "bfloat16"),  # the text config's
    ],
)
def test_the_checkpoints_dtype(config, expected):
    assert checkpoint_dtype(config) == expected


def test_auto_loads_a_bfloat16_checkpoint_in_bfloat16_and_sizes_blocks_with_it(bf16_dir):
    loaded = load_engine_model(EngineConfig(model=str(bf16_dir), dtype="auto"))
    assert (loaded.dtype, loaded.config.dtype) == (torch.bfloat16, "bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    m = loaded.model
    assert loaded.block_bytes == kv_block_bytes(
        m.num_layers, 16, m.num_kv_heads, m.head_dim, torch.bfloat16
    )
    default = load_engine_model(EngineConfig(model=str(bf16_dir)))  # float32 stays the default
    assert default.dtype == torch.float32 and default.block_bytes == 2 * loaded.block_bytes


def test_the_engine_sizes_its_pool_and_reports_in_the_resolved_dtype(bf16_dir):
    budget = 1024 * 1024
    fields = {"model": str(bf16_dir), "kv_cache_memory_bytes": budget, "block_size": 4}
    auto = EngineCore(EngineConfig(**fields, dtype="auto"))
    f32 = EngineCore(EngineConfig(**fields))
    try:
        assert (auto.dtype, auto.config.dtype) == (torch.bfloat16, "bfloat16")
        assert auto.config.num_kv_blocks == 2 * f32.config.num_kv_blocks  # half the bytes each
        assert auto.runner.kv_caches[0][0].dtype == torch.bfloat16
    finally:
        auto.shutdown()
        f32.shutdown()
