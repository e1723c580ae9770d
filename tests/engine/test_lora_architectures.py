"""PEFT adapters on architectures the transformers backend serves, against peft's greedy tokens.

Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``: the engine's targets are the model's own
linears) and Qwen3, tiny random checkpoints; adapters made with peft's ``get_peft_model`` and
their LoRA weights randomized (peft zero-inits ``lora_B``); one continuous batch mixes the base
model and two adapters, with chunked prefill, then a prefix-cache hit under an adapter. The
oracle is peft's ``PeftModel.generate`` in float32, greedy, one request at a time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

VOCAB = 512
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
ADAPTERS = {
    "phi3": {
        "fused": dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"]),
        "all": dict(r=8, lora_alpha=8, use_rslora=True, target_modules="all-linear"),
    },
    "qwen3": {
        "fused": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]),
        "all": dict(r=8, lora_alpha=8, use_rslora=True, target_modules="all-linear"),
    },
}
MAX_TOKENS = 8


def _config(arch: str):
    import transformers

    if arch == "phi3":
        return transformers.Phi3Config(**TEXT)
    return transformers.Qwen3Config(**TEXT, head_dim=16)


@pytest.fixture(scope="module", params=sorted(ADAPTERS))
def checkpoint(request, tmp_path_factory):
    """``(arch, model directory, {adapter name: adapter directory})``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loraplex.engine.models.tiny_model import _save_tokenizer_and_processor

    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(root / "model")
    _save_tokenizer_and_processor(Path(root / "model"), VOCAB, 512, True)
    adapters = {}
    for i, (name, kwargs) in enumerate(ADAPTERS[arch].items()):
        base = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(**kwargs))
        gen = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        peft_model.save_pretrained(root / name, safe_serialization=True)
        adapters[name] = str(root / name)
    return arch, str(root / "model"), adapters


def batch() -> list[tuple[str | None, list[int]]]:
    """``(adapter, prompt ids)``: the base model and both adapters, a shared 24-token prefix."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, VOCAB, (24,), generator=gen).tolist()
    other = torch.randint(3, VOCAB, (13,), generator=gen).tolist()
    return [
        (None, shared + [5, 6]),
        ("fused", shared + [5, 6]),
        ("all", other),
        ("fused", shared + [7]),
        ("all", shared + [5, 6]),
        (None, other),
    ]


def peft_greedy(model_dir: str, adapter_dir: str | None, prompt: list[int]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_mixed_adapter_batch_matches_peft(checkpoint):
    arch, model_dir, adapter_dirs = checkpoint
    expected = [
        peft_greedy(model_dir, adapter_dirs[a] if a else None, prompt) for a, prompt in batch()
    ]
    assert expected[0] != expected[1] and expected[0] != expected[4]  # the adapters matter
    llm = LLM(
        EngineConfig(
            model=model_dir,
            model_impl="transformers",
            block_size=4,
            max_num_batched_tokens=16,
            long_prefill_token_threshold=0,
            max_lora_rank=8,
        )
    )
    loaded = {name: llm.engine.add_lora_dir(path) for name, path in adapter_dirs.items()}
    names = llm.engine.adapter_limits.target_names
    if arch == "phi3":
        assert names == ("o_proj", "qkv_proj", "gate_up_proj", "down_proj")
        assert loaded["fused"].target_modules == ("gate_up_proj", "qkv_proj")
    assert set(loaded["all"].target_modules) == set(names)
    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [
        EngineRequest(
            request_id=f"r{i}",
            prompt_token_ids=prompt,
            sampling=sampling,
            lora_digest=loaded[a].digest if a else None,
        )
        for i, (a, prompt) in enumerate(batch())
    ]
    outs = llm.generate(requests)
    assert [out.outputs[0].token_ids for out in outs] == expected
    # Again, after the batch: the adapter's prefix blocks come from the prefix cache.
    again = llm.generate([EngineRequest(**{**vars(requests[3]), "request_id": "again"})])[0]
    assert again.outputs[0].token_ids == expected[3]
    assert again.num_cached_tokens >= 24 // 4 * 4
