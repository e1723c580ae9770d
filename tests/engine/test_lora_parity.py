"""Multi-LoRA batches against transformers + peft (float32 greedy tokens, one adapter at a time).

Three PEFT adapters made with peft itself on the tiny LLaVA: rank 4 attention-only, rank 8
MLP-only, rank 16 every language-model linear (rsLoRA); mixed with base-model requests, text
and images, in one continuous batch.
"""

import pytest
import torch

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.sampling.params import SamplingParams

from .conftest import long_text, photo, spec_used, user
from .test_engine_parity import hf_greedy

pytestmark = pytest.mark.slow

LM = r".*language_model.*\."
ADAPTERS = {
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=LM + r"(q_proj|k_proj|v_proj|o_proj)"),
    "mlp-r8": dict(r=8, lora_alpha=16, target_modules=LM + r"(gate_proj|up_proj|down_proj)"),
    "all-r16": dict(
        r=16,
        lora_alpha=16,
        use_rslora=True,
        target_modules=LM + r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
    ),
}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llava_dir, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import LlavaForConditionalGeneration

    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        base = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(**kw))
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_" in pname:  # peft zero-inits B: make every delta matter
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        peft_model.save_pretrained(root / name, safe_serialization=True)
        dirs[name] = str(root / name)
    return dirs


def batch():
    astro, cat = photo("astronaut"), photo("chelsea")
    shared = long_text(120, seed=11)
    return [
        (None, user("hello there"), 8),
        ("attn-r4", user("hello there"), 8),
        ("mlp-r8", user("what is this?", astro), 10),
        ("all-r16", user(shared + " go on"), 12),
        ("attn-r4", user("compare", astro, "and", cat), 6),
        (None, user(shared + " go on"), 9),
        ("all-r16", user("a cat", cat), 7),
        ("mlp-r8", user(long_text(40, seed=12)), 11),
    ]


@pytest.fixture(scope="module")
def peft_oracle(tiny_llava_dir, adapter_dirs):
    from peft import PeftModel
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    out = []
    for adapter, messages, max_tokens in batch():
        base = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32)
        model = base if adapter is None else PeftModel.from_pretrained(base, adapter_dirs[adapter])
        out.append(hf_greedy(model.eval(), processor, messages, max_tokens, True))
    return out


def run(llm, adapter_dirs, tag):
    digests = {name: llm.engine.add_lora_dir(path).digest for name, path in adapter_dirs.items()}
    reqs = [
        llm.make_request(
            messages,
            SamplingParams(temperature=0, max_tokens=k),
            lora_digest=digests[a] if a else None,
            request_id=f"{tag}-{i}",
        )
        for i, (a, messages, k) in enumerate(batch())
    ]
    return llm.generate(reqs)


def check(outs, oracle):
    for i, (out, (prompt, expected)) in enumerate(zip(outs, oracle, strict=True)):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == expected, f"request {i} differs from peft"


def test_adapters_change_the_output(peft_oracle):
    # The oracle itself: the same prompt under the base and an adapter differs.
    assert peft_oracle[0][1] != peft_oracle[1][1]


@pytest.mark.parametrize("slots", [(4, 8), (2, 8), (2, 2)], ids=["4-slots", "2-slots", "2-cpu"])
def test_mixed_adapter_batch_matches_peft(tiny_llava_dir, adapter_dirs, peft_oracle, slots, spec):
    max_loras, max_cpu = slots
    llm = LLM(
        EngineConfig(
            model=tiny_llava_dir,
            max_loras=max_loras,
            max_cpu_loras=max_cpu,
            max_lora_rank=16,
            **spec(tiny_llava_dir),
        )
    )
    check(run(llm, adapter_dirs, "a"), peft_oracle)
    spec_used(llm, spec)
    manager = llm.engine.lora_manager
    assert manager.slots_in_use == 0 and llm.engine.kv.pool.num_used == 0
    if max_loras == 2:
        assert manager.num_loads > 3  # three adapters cycled through two slots
    if max_cpu == 2:
        assert len(manager.cpu_digests) <= 2


def test_prefix_cache_is_per_adapter(tiny_llava_dir, adapter_dirs):
    llm = LLM(EngineConfig(model=tiny_llava_dir, max_lora_rank=16))
    a = llm.engine.add_lora_dir(adapter_dirs["attn-r4"]).digest
    b = llm.engine.add_lora_dir(adapter_dirs["mlp-r8"]).digest
    prompt = user(long_text(100, seed=13))
    sp = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([llm.make_request(prompt, sp, lora_digest=a)])[0]
    other = llm.generate([llm.make_request(prompt, sp, lora_digest=b)])[0]
    again = llm.generate([llm.make_request(prompt, sp, lora_digest=a)])[0]
    base = llm.generate([llm.make_request(prompt, sp)])[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0  # the same tokens under another adapter: computed in full
    assert base.num_cached_tokens == 0
    full_blocks = (len(prompt_ids := again.prompt_token_ids) - 1) // 16 * 16
    assert again.num_cached_tokens == full_blocks and len(prompt_ids) > 16
    assert llm.engine.kv.stats.by_source[("lora", a)].hit_tokens == full_blocks


def test_unknown_and_removed_adapters(tiny_llava_dir, adapter_dirs):
    llm = LLM(EngineConfig(model=tiny_llava_dir, max_lora_rank=16))
    sp = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(ValueError, match="unknown adapter"):
        llm.engine.add_request(llm.make_request(user("hi"), sp, lora_digest="f" * 64))
    digest = llm.engine.add_lora_dir(adapter_dirs["attn-r4"]).digest
    engine = llm.engine
    engine.add_request(
        llm.make_request(user(long_text(30)), sp, lora_digest=digest, request_id="inflight")
    )
    engine.step()
    assert engine.remove_lora(digest) is False  # in use: refused, the request finishes
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.remove_lora(digest) is True
    with pytest.raises(ValueError, match="unknown adapter"):
        engine.add_request(llm.make_request(user("hi"), sp, lora_digest=digest))
    assert engine.kv.pool.num_used == 0


def test_generate_cli_with_adapter_dirs(tiny_llava_dir, adapter_dirs, peft_oracle, tmp_path):
    import json

    from loraplex.gateway.cli import main as cli_main

    lines = [
        {
            "messages": m,
            "adapter": adapter_dirs[a] if a else None,
            "max_tokens": k,
            "temperature": 0,
        }
        for a, m, k in batch()[:4]
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert (
        cli_main(
            [
                "generate",
                "--model",
                tiny_llava_dir,
                "--input",
                str(inp),
                "--output",
                str(out),
                "--max-lora-rank",
                "16",
            ]
        )
        == 0
    )
    results = [json.loads(x) for x in out.read_text().splitlines()]
    for result, (_, expected) in zip(results, peft_oracle[:4], strict=True):
        assert result["outputs"][0]["token_ids"] == expected
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": batch()[0][1], "adapter": str(tmp_path)}) + "\n")
    assert (
        cli_main(["generate", "--model", tiny_llava_dir, "--input", str(bad), "--output", str(out)])
        == 1
    )
    assert "adapter_config.json" in json.loads(out.read_text())["error"]["message"]


def test_slots_bound_each_step_and_waiting_adapters_keep_fifo(tiny_llava_dir, adapter_dirs):
    llm = LLM(EngineConfig(model=tiny_llava_dir, max_loras=1, max_cpu_loras=2, max_lora_rank=16))
    engine = llm.engine
    a = engine.add_lora_dir(adapter_dirs["attn-r4"]).digest
    b = engine.add_lora_dir(adapter_dirs["mlp-r8"]).digest
    sp = SamplingParams(temperature=0, max_tokens=4)
    for rid, digest in (("A1", a), ("B1", b), ("A2", a), ("base", None)):
        engine.add_request(
            llm.make_request(user(long_text(12)), sp, lora_digest=digest, request_id=rid)
        )
    first_seen = {}
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        running = engine.scheduler.running
        assert len({s.request.lora_digest for s in running} - {None}) <= 1
        for seq in running:
            first_seen.setdefault(seq.request.request_id, step)
    # B1 waited for A1's slot; A2 did not overtake B1 although A's adapter was resident; the
    # base request behind them waited too (first come, first served, no starvation).
    assert first_seen["A1"] < first_seen["B1"] <= first_seen["A2"]
    assert first_seen["base"] >= first_seen["A2"]
    assert engine.lora_manager.slots_in_use == 0 and engine.kv.pool.num_used == 0


def test_hot_add_and_remove_while_serving(tiny_llava_dir, adapter_dirs):
    import asyncio

    from loraplex.engine.client.front import AsyncLLM

    llm = LLM(EngineConfig(model=tiny_llava_dir, max_lora_rank=16))
    adapter = llm.engine.core.adapters.read(adapter_dirs["mlp-r8"])
    async_llm = AsyncLLM.in_process(engine=llm.engine)

    async def scenario():
        await async_llm.add_lora(adapter)
        req = llm.make_request(
            user(long_text(20)),
            SamplingParams(temperature=0, max_tokens=30),
            lora_digest=adapter.digest,
            request_id="hot",
        )
        stream = async_llm.generate(req)
        first = await stream.__anext__()
        assert not first.finished
        assert await async_llm.remove_lora(adapter.digest) is False  # in flight: refused
        last = first
        async for out in stream:
            last = out
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert await async_llm.remove_lora(adapter.digest) is True
        late = llm.make_request(
            user("hi"),
            SamplingParams(temperature=0, max_tokens=2),
            lora_digest=adapter.digest,
            request_id="late",
        )
        with pytest.raises(ValueError, match="unknown adapter"):
            async for _ in async_llm.generate(late):
                pass

    try:
        asyncio.run(scenario())
    finally:
        async_llm.shutdown()
    assert llm.engine.kv.pool.num_used == 0 and llm.engine.lora_manager.slots_in_use == 0


def test_each_adapter_is_one_contiguous_segment_of_the_batch(tiny_llava_dir, adapter_dirs):
    llm = LLM(EngineConfig(model=tiny_llava_dir, max_loras=4, max_lora_rank=16))
    engine = llm.engine
    a = engine.add_lora_dir(adapter_dirs["attn-r4"]).digest
    b = engine.add_lora_dir(adapter_dirs["mlp-r8"]).digest
    sp = SamplingParams(temperature=0, max_tokens=3)
    order = [a, None, b, a, None, b, a]
    for i, digest in enumerate(order):
        engine.add_request(
            llm.make_request(user(long_text(4 + i)), sp, lora_digest=digest, request_id=f"r{i}")
        )
    schedule = engine.scheduler.schedule
    batches = []

    def recording():
        out = schedule()
        batches.append([s.lora_slot for s in out.scheduled])  # -1: the base model
        return out

    engine.scheduler.schedule = recording
    while engine.has_unfinished_requests():
        engine.step()
    assert any(len(set(batch)) == 3 for batch in batches)
    for batch in batches:
        runs = [d for i, d in enumerate(batch) if i == 0 or batch[i - 1] != d]
        assert len(runs) == len(set(runs)), batch  # no adapter appears in two runs
        assert batch[: batch.count(-1)] == [-1] * batch.count(-1)  # base model first
