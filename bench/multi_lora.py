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

On a GPU (``--device cuda``, ``bench.device``: bfloat16 unless ``--dtype`` says otherwise) the
default model is the ``llama-1b`` preset (1.05B parameters, ``bench.presets``), the adapters
are written in bfloat16, 128 requests run at 1 and 64 adapters, and peft runs on the same GPU
in the same dtype (``autocast_adapter_dtype=False``: peft would otherwise upcast bfloat16
adapters to float32, which the engine does not do). Peak GPU memory is reported per system.

Each engine first runs the workload's first 32 requests (new ids, 2 output tokens, their
adapters) untimed, so the LoRA path's one-time costs (Triton's compilations on a GPU) land
there; slot loads count only the timed run's. peft gets one untimed 2-token ``generate``.

Run: ``python -m bench.multi_lora [--quick] [--device cpu|cuda] [--dtype D]
[--attention-backend torch|triton] [--preset tiny|bench|llama-1b] [--requests N] [--tokens N]
[--adapters 1,64] [--passes 1|2] [--max-loras N]``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.device import Target, add_arguments, target_from_args
from bench.presets import preset_dir
from bench.throughput import CPU, padded_generate
from bench.throughput_impls import fresh_tokens
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

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
    return preset_dir("tiny" if quick else "bench")


def write_adapters(
    root: Path,
    cfg: dict,
    count: int,
    prefix: str = "base_model.model.model",
    dtype: torch.dtype = torch.float32,
) -> list[str]:
    """``count`` random PEFT LoRA adapters (rank 16, every projection) in PEFT's file format.

    ``cfg`` is the (text) model config; ``prefix`` is where PEFT puts the decoder layers
    (``base_model.model.model.language_model`` for a LLaVA). ``target_modules`` is a regex over
    the decoder layers only (a plain list of names would also reach a LLaVA's vision tower,
    which validation refuses). The weights are drawn in float32 and saved in ``dtype``; an
    adapter already on disk is kept.
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
                a = torch.randn(RANK, fan_in, generator=gen) * 0.02
                b = torch.randn(fan_out, RANK, generator=gen) * 0.02
                tensors[f"{key}.lora_A.weight"] = a.to(dtype)
                tensors[f"{key}.lora_B.weight"] = b.to(dtype)
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


def run_engine(path, dirs, prompts, output_tokens, max_loras, target: Target = CPU) -> dict:
    """One continuous batch of ``prompts`` (each with its adapter) through a new engine."""
    llm = LLM(
        EngineConfig(
            model=str(path),
            max_num_seqs=128,
            max_num_batched_tokens=4096,
            num_kv_blocks=4096,
            max_loras=max_loras,
            max_cpu_loras=max(max_loras, 64),
            max_lora_rank=RANK,
            **target.engine(),
        )
    )
    engine = llm.engine
    digests = [engine.add_lora_dir(d).digest for d in sorted({dirs[a] for _, a in prompts})]
    by_dir = dict(zip(sorted({dirs[a] for _, a in prompts}), digests, strict=True))
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    llm.generate([EngineRequest("warm", [20] * 8, SamplingParams(temperature=0, max_tokens=2))])
    # The LoRA path too (first-use costs, Triton's compilations on a GPU), not timed.
    head = prompts[:32]
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    fresh = fresh_tokens([p for p, _ in head], vocab, seed=77)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(
        [
            EngineRequest(f"warm{i}", p, warm, lora_digest=by_dir[dirs[a]])
            for i, (p, (_, a)) in enumerate(zip(fresh, head, strict=True))
        ]
    )
    manager = engine.lora_manager
    loads_before = manager.num_loads
    target.reset_peak()
    target.sync()
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
    target.sync()
    elapsed = time.perf_counter() - t0
    loads = manager.num_loads - loads_before
    peak = target.peak_gib()
    # Cold load: an adapter in neither tier, read from disk, validated, copied into a slot
    # (the engine's registry still knows its directory: the manager's loader reads it again).
    cold = digests[-1]
    assert manager.remove(cold)
    target.sync()
    t1 = time.perf_counter()
    slot = manager.acquire(cold)
    target.sync()
    cold_ms = (time.perf_counter() - t1) * 1e3
    assert slot is not None
    manager.release(cold)
    llm.shutdown()
    del llm, engine, manager
    target.release()
    return {
        "tokens_per_s": produced / elapsed,
        "seconds": elapsed,
        "cold_load_ms": cold_ms,
        "loads": loads,
        "peak_gib": peak,
    }


def run_peft(path, dirs, prompts, output_tokens, target: Target = CPU) -> dict:
    """The baseline: transformers + peft serving one adapter at a time.

    Each adapter's requests run as one padded ``generate`` batch after ``set_adapter`` (every
    used adapter loaded beforehand, untimed).
    """
    from peft import PeftModel

    base = target.hf_model(path)
    used = sorted({a for _, a in prompts})
    keep = {"autocast_adapter_dtype": False}  # adapters in the model's dtype, as the engine
    model = PeftModel.from_pretrained(base, dirs[used[0]], adapter_name=f"a{used[0]}", **keep)
    for a in used[1:]:
        model.load_adapter(dirs[a], adapter_name=f"a{a}", **keep)
    model.eval()
    pad = 0
    model.set_adapter(f"a{used[0]}")
    padded_generate(model, [prompts[0][0]], 2, pad)  # warm-up, not timed
    target.reset_peak()
    target.sync()
    t0 = time.perf_counter()
    produced = 0
    for a in used:
        model.set_adapter(f"a{a}")
        batch = [p for p, x in prompts if x == a]
        produced += padded_generate(model, batch, output_tokens, pad) * len(batch)
    target.sync()
    elapsed = time.perf_counter() - t0
    peak = target.peak_gib()
    del model, base
    target.release()
    return {"tokens_per_s": produced / elapsed, "seconds": elapsed, "peak_gib": peak}


def combine(runs: list[dict]) -> dict:
    """One figure from repeated runs of a configuration: total tokens over total seconds."""
    seconds = sum(r["seconds"] for r in runs)
    tokens = sum(r["tokens_per_s"] * r["seconds"] for r in runs)
    return {
        "tokens_per_s": tokens / seconds,
        "seconds": seconds / len(runs),
        "cold_load_ms": min(r["cold_load_ms"] for r in runs),
        "loads": runs[0]["loads"],
        "peak_gib": runs[0]["peak_gib"],
        "spread": max(r["tokens_per_s"] for r in runs) / min(r["tokens_per_s"] for r in runs),
    }


def defaults(quick: bool, cuda: bool) -> dict:
    """Preset, requests, output tokens and adapter counts when the options leave them out."""
    if quick:
        return {"preset": "tiny", "requests": 64, "tokens": 8, "adapters": [1, 8, 64]}
    if cuda:
        return {"preset": "llama-1b", "requests": 128, "tokens": 32, "adapters": [1, 64]}
    return {"preset": "bench", "requests": 256, "tokens": 32, "adapters": [1, 8, 64, 512]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 64 requests")
    parser.add_argument(
        "--preset",
        choices=["tiny", "bench", "llama-1b"],
        help="the model (default: tiny with --quick, llama-1b on cuda, else bench)",
    )
    parser.add_argument("--requests", type=int, help="requests per configuration")
    parser.add_argument("--tokens", type=int, help="output tokens each")
    parser.add_argument(
        "--adapters",
        help="comma-separated adapter counts, 1 and 64 among them (default: 1,8,64,512 on "
        "cpu, 1,64 on cuda)",
    )
    parser.add_argument(
        "--passes",
        type=int,
        choices=[1, 2],
        default=2,
        help="engine runs per configuration: 2 mirrored around the peft baseline (default), "
        "or 1 before it",
    )
    parser.add_argument("--max-loras", type=int, default=32, help="device slots (default 32)")
    add_arguments(parser)
    args = parser.parse_args()
    target = target_from_args(parser, args)
    d = defaults(args.quick, target.is_cuda)
    preset = args.preset or d["preset"]
    n, output_tokens = args.requests or d["requests"], args.tokens or d["tokens"]
    counts = d["adapters"]
    if args.adapters:
        counts = sorted({int(c) for c in args.adapters.split(",")})
    if not {1, 64} <= set(counts):
        parser.error("--adapters must include 1 (the ratios' base) and 64 (peft's workload)")
    path = preset_dir(preset)
    cfg = json.loads((path / "config.json").read_text())
    dtype = torch.bfloat16 if preset == "llama-1b" else torch.float32
    dirs = write_adapters(path.parent / f"{path.name}-adapters", cfg, max(counts), dtype=dtype)
    # These machines drift by 10-20% over minutes: every engine configuration runs twice, in
    # mirrored order around the peft baseline (1, 8, 64, 512, peft, 512, 64, 8, 1), so a linear
    # drift cancels out of the ratios; each figure is the two runs' tokens over their seconds.
    runs: dict[int, list[dict]] = {c: [] for c in counts}

    def engine_pass(order):
        for c in order:
            prompts = workload(n, cfg["vocab_size"], c)
            slots = min(c, args.max_loras)
            runs[c].append(run_engine(path, dirs, prompts, output_tokens, slots, target))

    engine_pass(counts)
    peft = run_peft(path, dirs, workload(n, cfg["vocab_size"], 64), output_tokens, target)
    if args.passes == 2:
        engine_pass(counts[::-1])
    results = {c: combine(r) for c, r in runs.items()}
    one = results[1]["tokens_per_s"]
    print(
        f"model {path.name}; {n} requests, {output_tokens} output tokens, rank {RANK}, "
        f"Zipf(1.1) popularity; {target.describe()}"
    )
    print(
        f"{'adapters':<26}{'tok/s':>10}{'vs 1':>8}{'seconds':>10}{'slot loads':>12}"
        f"{'run spread':>12}{'peak GiB':>10}"
    )
    for c, r in results.items():
        print(
            f"{c:<26}{r['tokens_per_s']:>10.1f}{r['tokens_per_s'] / one:>8.2f}"
            f"{r['seconds']:>10.2f}{r['loads']:>12}{r['spread']:>12.2f}{_gib(r['peak_gib']):>10}"
        )
    print(
        f"{'peft, 64, one at a time':<26}{peft['tokens_per_s']:>10.1f}"
        f"{peft['tokens_per_s'] / one:>8.2f}{peft['seconds']:>10.2f}{'':>24}"
        f"{_gib(peft['peak_gib']):>10}"
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
            "output_tokens": output_tokens,
            "preset": preset,
            "passes": args.passes,
            "peak_gib_64": results[64]["peak_gib"],
            "peft_peak_gib": peft["peak_gib"],
            **target.figures(),
        }
    )
    print(json.dumps(out))


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
