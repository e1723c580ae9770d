"""Real PEFT adapters made against the tiny models, and the served-model facts to validate them."""

from __future__ import annotations

import copy
import functools
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from loraplex.adapters.base_model import BaseModelInfo, ModelTargets, model_targets
from loraplex.adapters.errors import AdapterError
from loraplex.adapters.limits import AdapterLimits
from loraplex.adapters.store import AdapterStore

MAX_RANK = 16
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""What a Llama-family decoder layer's linears are called (transformers' ``LlamaDecoderLayer``)."""


@pytest.fixture(scope="module", autouse=True)
def _torch_threads(one_torch_thread):
    """Every module here runs tiny models: one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def text_base(hf_text):
    return hf_text


@pytest.fixture(scope="session")
def llava_base(hf_llava):
    return hf_llava


def served(model_dir) -> dict:
    """The keyword arguments validation takes for a served model directory."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    limits = AdapterLimits(targets=model_targets(config), max_rank=MAX_RANK)
    return {"limits": limits, "info": BaseModelInfo(names=("tiny", str(model_dir)))}


@functools.cache
def llama_targets(num_layers: int) -> ModelTargets:
    """A Llama's targets, as transformers builds it on the meta device (any width: tiny)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return model_targets(config)


@pytest.fixture(scope="session")
def text_kw(text_dir):
    return served(text_dir)


@pytest.fixture(scope="session")
def llava_kw(llava_dir):
    return served(llava_dir)


def make_adapter(base, out_dir: Path, *, seed: int = 0, safe: bool = True, **lora_kwargs):
    """Wrap a copy of ``base`` with PEFT, randomize every LoRA tensor, save it.

    Returns:
        ``(out_dir, PEFT's state dict, the PeftModel)``.
    """
    with warnings.catch_warnings():  # transformers' deprecation notes, PEFT's embedding notice
        warnings.simplefilter("ignore")
        model = get_peft_model(copy.deepcopy(base), LoraConfig(**lora_kwargs))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:  # PEFT initializes lora_B to zero
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        model.save_pretrained(str(out_dir), safe_serialization=safe)
        return Path(out_dir), get_peft_model_state_dict(model), model


def edit_config(adapter_dir: Path, **changes) -> Path:
    """Rewrite keys of ``adapter_config.json`` in place (None deletes a key)."""
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return adapter_dir


def edit_tensors(adapter_dir: Path, fn) -> Path:
    """Replace the weights with ``fn(dict of tensors)``'s result."""
    path = adapter_dir / "adapter_model.safetensors"
    tensors = fn(load_file(str(path)))
    tensors = {k: v.clone().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return adapter_dir


def store_snapshot(store: AdapterStore) -> list[str]:
    """Every path under the store's root (to show a refusal changed nothing)."""
    return sorted(
        os.path.relpath(os.path.join(d, f), store.root)
        for d, dirs, files in os.walk(store.root)
        for f in dirs + files
    )


def assert_refused(store: AdapterStore, adapter, kw: dict, match: str) -> AdapterError:
    """``adapter`` (a directory or ``(config_bytes, weights_bytes)``) is refused, store intact."""
    before = store_snapshot(store)
    with pytest.raises(AdapterError, match=match) as info:
        if isinstance(adapter, tuple):
            store.put_files(*adapter, **kw)
        else:
            store.put_dir(adapter, **kw)
    assert store_snapshot(store) == before
    return info.value
