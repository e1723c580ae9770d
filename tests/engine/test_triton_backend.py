"""The engine with ``attention_backend="triton"`` (the kernels under the Triton interpreter).

Same greedy tokens as the torch backend on the tiny text model: decodes, a chunked prefill over
a cached prefix, and LoRA requests of two adapters with different ranks mixed with base ones.
"""

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path, cfg, rank, targets, seed):
    """A random PEFT LoRA adapter for the tiny text Llama (B non-zero so the delta matters)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name in targets:
            parent = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            fan_in, fan_out = shapes[name]
            key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.3
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def adapters(tiny_text_dir, tmp_path_factory):
    cfg = json.loads((Path(tiny_text_dir) / "config.json").read_text())
    root = tmp_path_factory.mktemp("triton-adapters")
    return [
        write_adapter(root / "r8-all", cfg, 8, TARGETS, seed=1),
        write_adapter(root / "r4-qv", cfg, 4, ("q_proj", "v_proj"), seed=2),
    ]


def run(model_dir, adapter_dirs, backend):
    llm = LLM(
        EngineConfig(
            model=model_dir,
            attention_backend=backend,
            num_kv_blocks=64,
            max_num_batched_tokens=24,  # the 44-token prompt below is prefilled in chunks
            max_lora_rank=8,
        )
    )
    assert llm.engine.runner.lora_backend.name == backend  # chosen once, by the core
    digests = [llm.engine.add_lora_dir(d).digest for d in adapter_dirs]
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(16, 200, (36,), generator=gen).tolist()

    def req(rid, prompt, max_tokens, lora=None):
        return EngineRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            lora_digest=lora,
        )

    first = llm.generate([req("warm", prefix + [17, 18], 2)])
    later = llm.generate(
        [
            req("chunked", prefix + torch.randint(16, 200, (8,), generator=gen).tolist(), 3),
            req("short", [20, 21, 22, 23, 24], 3),
            req("lora-a", [20, 21, 22, 23, 24], 3, digests[0]),
            req("lora-b", [40, 41, 42], 3, digests[1]),
        ]
    )
    return first + later


@pytest.mark.slow
def test_triton_backend_matches_torch_greedy(tiny_text_dir, adapters):
    t0 = time.perf_counter()
    expected = run(tiny_text_dir, adapters, "torch")
    t1 = time.perf_counter()
    got = run(tiny_text_dir, adapters, "triton")
    t2 = time.perf_counter()
    print(f"torch {t1 - t0:.2f}s triton {t2 - t1:.2f}s")
    assert got[1].num_cached_tokens == 32  # two full blocks of the shared prefix hit
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, g.request_id
    # The adapter changes the tokens (so the LoRA path is exercised, not skipped).
    assert expected[2].outputs[0].token_ids != expected[3].outputs[0].token_ids
