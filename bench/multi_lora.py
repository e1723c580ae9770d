"""Benchmark: multi-LoRA throughput against one adapter and against transformers + peft (issue 4).

The same 256 requests (prompts of 32-128 tokens, 32 output tokens, greedy, EOS ignored) are
served with 1, 8, 64 and 512 distinct rank-16 adapters (all language-model projections), picked
with Zipf popularity (s = 1.1), in one continuous batch per configuration. Ratios are against
the one-adapter run of the same process. The baseline is S-LoRA's: transformers + peft serving
the 64-adapter workload one adapter at a time (each adapter's requests as one padded batch,
``set_adapter`` between them). Also measured: the time to make a cold adapter resident (read,
validate, copy into a device slot).

Each engine configuration runs twice, in mirrored order around the peft baseline, and is
reported as the two runs' tokens over their seconds (these machines drift by 10-20% over
minutes; mirroring cancels a linear drift out of the ratios); "run spread" is the faster run
over the slower.

Run: ``python -m bench.multi_lora [--quick]``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.throughput import padded_generate
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.gateway.settings import data_dir

RANK = 16
PROJ = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def model_dir(quick: bool) -> Path:
    """The small text model: the tiny one for ``--quick``, the 26M ``bench`` preset otherwise."""
    from loraplex.engine.models.tiny_model import init_tiny

    name = "tiny-text" if quick else "tiny-text-bench"
    target = data_dir() / "bench" / name
    if not (target / "config.json").exists():
        init_tiny(target, seed=0, text_only=True, **({} if quick else {"preset": "bench"}))
    return target


def write_adapters(
    root: Path, cfg: dict, count: int, prefix: str = "base_model.model.model"
) -> list[str]:
    """``count`` random PEFT LoRA adapters (rank 16, every projection) in PEFT's file format.

    ``cfg`` is the (text) model config; ``prefix`` is where PEFT puts the decoder layers
    (``base_model.model.model.language_model`` for a LLaVA). ``target_modules`` is a regex over
    the decoder layers only (a plain list of names would also reach a LLaVA's vision tower,
    which validation refuses).
    """
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    layers = re.escape(prefix.removeprefix("base_model.model.") + ".layers")
    targets = rf"{layers}\.\d+\.(?:self_attn|mlp)\.(?:{'|'.join(sorted(PROJ))})"
    dirs = []
    for n in range(count):
        d = root / f"adapter-{n:03d}"
        dirs.append(str(d))
        d.mkdir(parents=True, exist_ok=True)
        _write_config(d, targets)
        if (d / "adapter_model.safetensors").exists():
            continue
        gen = torch.Generator().manual_seed(1000 + n)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for proj, parent in PROJ.items():
                fan_in, fan_out = shapes[proj]
                key = f"{prefix}.layers.{layer}.{parent}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.02
        save_file(tensors, str(d / "adapter_model.safetensors"))
    return dirs


def _write_config(directory: Path, target_modules: str) -> None:
    """PEFT's ``adapter_config.json`` of :func:`write_adapters`' adapters."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 32,
        "target_modules": target_modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))


def workload(n: int, vocab: int, num_adapters: int, seed: int = 0):
    """(prompt, adapter index) pairs; adapter popularity is Zipf(1.1)."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, num_adapters + 1, dtype=torch.float64)
    weights = ranks.pow(-1.1)
    picks = torch.multinomial(weights / weights.sum(), n, replacement=True, generator=gen)
    prompts = []
    for i in range(n):
        length = int(torch.randint(32, 129, (1,), generator=gen))
        prompts.append((torch.randint(16, vocab, (length,), generator=gen).tolist(), int(picks[i])))
    return prompts


def run_engine(path, dirs, prompts, output_tokens, max_loras) -> dict:
    llm = LLM(
        EngineConfig(
            model=str(path),
            max_num_seqs=128,
            max_num_batched_tokens=4096,
            num_kv_blocks=4096,
            max_loras=max_loras,
            max_cpu_loras=max(max_loras, 64),
            max_lora_rank=RANK,
        )
    )
    engine = llm.engine
    digests = [engine.add_lora_dir(d).digest for d in sorted({dirs[a] for _, a in prompts})]
    by_dir = dict(zip(sorted({dirs[a] for _, a in prompts}), digests, strict=True))
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    llm.generate([EngineRequest("warm", [20] * 8, SamplingParams(temperature=0, max_tokens=2))])
    t0 = time.perf_counter()
    for i, (prompt, a) in enumerate(prompts):
        engine.add_request(
            EngineRequest(f"r{i}", list(prompt), params, lora_digest=by_dir[dirs[a]])
        )
    produced = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                produced += out.outputs[0].num_tokens  # running total (DELTA outputs)
    elapsed = time.perf_counter() - t0
    # Cold load: an adapter in neither tier, read from disk, validated, copied into a slot.
    manager = engine.lora_manager
    cold = digests[-1]
    manager.remove(cold)
    engine._adapter_dirs[cold] = next(d for d, g in by_dir.items() if g == cold)
    t1 = time.perf_counter()
    slot = manager.acquire(cold)
    cold_ms = (time.perf_counter() - t1) * 1e3
    assert slot is not None
    manager.release(cold)
    return {
        "tokens_per_s": produced / elapsed,
        "seconds": elapsed,
        "cold_load_ms": cold_ms,
        "loads": manager.num_loads,
    }


def run_peft(path, dirs, prompts, output_tokens) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    used = sorted({a for _, a in prompts})
    model = PeftModel.from_pretrained(base, dirs[used[0]], adapter_name=f"a{used[0]}")
    for a in used[1:]:
        model.load_adapter(dirs[a], adapter_name=f"a{a}")
    pad = 0
    t0 = time.perf_counter()
    produced = 0
    for a in used:
        model.set_adapter(f"a{a}")
        batch = [p for p, x in prompts if x == a]
        produced += padded_generate(model, batch, output_tokens, pad) * len(batch)
    elapsed = time.perf_counter() - t0
    return {"tokens_per_s": produced / elapsed, "seconds": elapsed}


def combine(runs: list[dict]) -> dict:
    """One figure from repeated runs of a configuration: total tokens over total seconds."""
    seconds = sum(r["seconds"] for r in runs)
    tokens = sum(r["tokens_per_s"] * r["seconds"] for r in runs)
    return {
        "tokens_per_s": tokens / seconds,
        "seconds": seconds / len(runs),
        "cold_load_ms": min(r["cold_load_ms"] for r in runs),
        "loads": runs[0]["loads"],
        "spread": max(r["tokens_per_s"] for r in runs) / min(r["tokens_per_s"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 64 requests")
    args = parser.parse_args()
    n, output_tokens = (64, 8) if args.quick else (256, 32)
    counts = [1, 8, 64] if args.quick else [1, 8, 64, 512]
    path = model_dir(args.quick)
    cfg = json.loads((path / "config.json").read_text())
    dirs = write_adapters(path.parent / f"{path.name}-adapters", cfg, max(counts))
    # These machines drift by 10-20% over minutes: every engine configuration runs twice, in
    # mirrored order around the peft baseline (1, 8, 64, 512, peft, 512, 64, 8, 1), so a linear
    # drift cancels out of the ratios; each figure is the two runs' tokens over their seconds.
    runs: dict[int, list[dict]] = {c: [] for c in counts}

    def engine_pass(order):
        for c in order:
            prompts = workload(n, cfg["vocab_size"], c)
            runs[c].append(run_engine(path, dirs, prompts, output_tokens, max_loras=min(c, 32)))

    engine_pass(counts)
    peft = run_peft(path, dirs, workload(n, cfg["vocab_size"], 64), output_tokens)
    engine_pass(counts[::-1])
    results = {c: combine(r) for c, r in runs.items()}
    one = results[1]["tokens_per_s"]
    print(
        f"model {path.name}; {n} requests, {output_tokens} output tokens, rank {RANK}, "
        f"Zipf(1.1) popularity"
    )
    print(
        f"{'adapters':<26}{'tok/s':>10}{'vs 1':>8}{'seconds':>10}{'slot loads':>12}"
        f"{'run spread':>12}"
    )
    for c, r in results.items():
        print(
            f"{c:<26}{r['tokens_per_s']:>10.1f}{r['tokens_per_s'] / one:>8.2f}"
            f"{r['seconds']:>10.2f}{r['loads']:>12}{r['spread']:>12.2f}"
        )
    print(
        f"{'peft, 64, one at a time':<26}{peft['tokens_per_s']:>10.1f}"
        f"{peft['tokens_per_s'] / one:>8.2f}{peft['seconds']:>10.2f}"
    )
    out = {f"ratio_{c}_vs_1": round(results[c]["tokens_per_s"] / one, 3) for c in counts[1:]}
    out.update(
        {
            "ratio_vs_peft": round(results[64]["tokens_per_s"] / peft["tokens_per_s"], 2),
            "cold_load_ms": round(results[max(counts)]["cold_load_ms"], 1),
            "tokens_per_s_1": round(one, 1),
            "tokens_per_s_64": round(results[64]["tokens_per_s"], 1),
            "peft_tokens_per_s": round(peft["tokens_per_s"], 1),
            "requests": n,
        }
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
