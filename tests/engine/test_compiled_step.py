"""The compiled step (``--cpu-compile``, ``engine.runner.compiled_step``): the same greedy tokens
as the eager forward, with adapters mixed in one batch, chunked prefill and prefix hits; when it
applies and when it does not."""

import pytest
import torch

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.models import packed_linear
from loraplex.engine.request import EngineRequest
from loraplex.engine.runner.compiled_step import (
    CompiledStep,
    StepContext,
    compile_refusal,
    step_context,
)
from loraplex.engine.sampling.params import SamplingParams


def test_refusals():
    class Model:
        supports_compile = True

    cfg = EngineConfig(model="m", cpu_compile=True)
    assert compile_refusal(cfg, Model()) is None
    assert compile_refusal(cfg.replace(cpu_compile=False), Model()) == "--cpu-compile is off"
    assert compile_refusal(cfg.replace(enforce_eager=True), Model()) == "--enforce-eager"
    assert "CUDA" in compile_refusal(cfg.replace(device="cuda"), Model())
    assert "supports_compile" in compile_refusal(cfg, object())


def test_ops_refuse_to_run_outside_a_step():
    q = torch.zeros(2, 1, 4)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.loraplex.paged_attention(q, q, q, 0, 1.0, -1)
    with step_context(StepContext(None, None, [])):
        pass
    with pytest.raises(RuntimeError, match="outside"):  # the context is left behind
        torch.ops.loraplex.lora_delta_(torch.zeros(2, 3), torch.zeros(2, 4), 0, "q_proj")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_text_dir, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("compiled-adapters")
    dirs = {}
    for i, targets in enumerate([["q_proj", "v_proj"], ["gate_proj", "down_proj", "o_proj"]]):
        base = AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32)
        model = get_peft_model(
            base, LoraConfig(r=4 * (i + 1), lora_alpha=8, target_modules=targets)
        )
        gen = torch.Generator().manual_seed(7 + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:  # peft zero-inits B: make every delta matter
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        model.save_pretrained(root / f"a{i}")
        dirs[f"a{i}"] = str(root / f"a{i}")
    return dirs


def _run(llm, adapter_dirs, tag):
    digests = [None] + [llm.engine.add_lora_dir(d).digest for d in adapter_dirs.values()]
    shared = [11, 12, 13, 14, 15, 16, 17, 18] * 5  # a 40-token prefix: prefix-cache hits
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    reqs = [
        EngineRequest(
            f"{tag}-{i}",
            shared + [20 + i] * (i + 1),
            params,
            lora_digest=digests[i % len(digests)],
        )
        for i in range(7)
    ]
    first = llm.generate(reqs[:1])  # the prefix cached, then the batch hits it
    return first + llm.generate(reqs[1:])


@pytest.mark.slow  # one inductor compilation of the tiny model (10-30 s)
def test_compiled_step_matches_eager(tiny_text_dir, adapter_dirs, monkeypatch):
    # The tiny model's linears are below the packing threshold: pack them anyway, so the
    # compiled graph calls the packed-GEMM op as a real model's does.
    monkeypatch.setattr(packed_linear, "MIN_PACK_ELEMENTS", 0)
    common = dict(model=tiny_text_dir, max_num_batched_tokens=24, max_lora_rank=8)
    compiled = LLM(EngineConfig(cpu_compile=True, **common))
    assert any(isinstance(m, packed_linear.PackedLinear) for m in compiled.engine.model.modules())
    step = compiled.engine.runner.compiled_step
    assert isinstance(step, CompiledStep) and step.compile_seconds > 0
    eager = LLM(EngineConfig(**common))
    assert eager.engine.runner.compiled_step is None
    graphs = dict(torch._dynamo.utils.counters["stats"])
    got = _run(compiled, adapter_dirs, "c")
    # No step recompiled: the warm-up's graph (T >= 2) served every prefill chunk and batch.
    assert dict(torch._dynamo.utils.counters["stats"]) == graphs
    want = _run(eager, adapter_dirs, "e")
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want]
    assert any(o.num_cached_tokens for o in got)
    # The LoRA op ran inside the compiled graph: an adapter changes the same prompt's tokens.
    digest = compiled.engine.add_lora_dir(adapter_dirs["a1"]).digest
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    prompt = [30, 31, 32, 33, 34, 35]
    base, tuned = compiled.generate(
        [
            EngineRequest("base", prompt, params),
            EngineRequest("tuned", prompt, params, lora_digest=digest),
        ]
    )
    assert base.outputs[0].token_ids != tuned.outputs[0].token_ids
