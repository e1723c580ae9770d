"""``bench.throughput --preset smollm-135m``: the real 135M checkpoint's shape, default flags.

Model: the built-in text model with SmolLM-135M's shape (``tiny_model`` preset ``smollm-135m``:
Llama, 30 layers, hidden 576, MLP 1536, 9 query / 3 KV heads, head_dim 64, vocab 49152, tied
embeddings, 134.5M parameters), random weights, float32. Workload (issue 14): 32 requests of
100-400 random prompt tokens, 64 output tokens each (EOS ignored), greedy, no shared prefix.

loraplex runs them with the engine's default flags, so the KV pool is the one sized from the
machine (``engine.kv_cache.sizing``); for comparison the same batch with the old fixed 256 MiB pool
(``kv_cache_memory_bytes``), which ran it in about twice the steps. transformers runs
``generate`` over left-padded batches of 8, 16 and 32 in the same run; the best is the baseline.
Reported: output tokens/s, engine steps, the pool, and the ratio to transformers.

``--device``, ``--dtype`` and ``--attention-backend`` (``bench.device``) run both sides on a
GPU; the sized pool then takes ``gpu_memory_utilization`` of the device, and each engine is
dropped (``Target.release``) before the next is built.

``--model-impl native|transformers`` picks the engine's model implementation (default ``auto``:
the native Llama); ``--model-impl both`` runs the native model and the transformers backend in
interleaved rounds instead (``bench.throughput_impls``; no ``generate`` baseline).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench.device import Target
from bench.presets import preset_dir
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

OLD_DEFAULT_BYTES = 256 * 1024 * 1024


def model_dir() -> Path:
    """The smollm-135m-shaped text model, written once into the data directory (13 s)."""
    return preset_dir("smollm-135m")


def workload(num_requests: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 100-400 random token ids (above the special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(100, 401, (num_requests,), generator=gen).tolist()
    return [torch.randint(16, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_loraplex(path: Path, prompts, output_tokens: int, target: Target, **config) -> dict:
    """One continuous batch through ``LLM`` built with ``config`` on top of the defaults."""
    from bench.throughput import warm_up

    llm = LLM(EngineConfig(model=str(path), **config, **target.engine()))
    engine = llm.engine
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    warm_up(llm, prompts, target, vocab)  # not timed
    engine.step_stats.reset()
    target.reset_peak()
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    requests = [EngineRequest(f"r{i}", list(p), params) for i, p in enumerate(prompts)]
    target.sync()
    t0 = time.perf_counter()
    outs = llm.generate(requests)
    target.sync()
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    sizing = engine.kv_sizing
    figures = {
        "tokens_per_s": produced / elapsed,
        "seconds": elapsed,
        "steps": engine.step_stats.num_steps,
        "kv_blocks": sizing.num_blocks,
        "kv_gib": sizing.pool_bytes / 2**30,
        "kv_rule": sizing.rule,
        "pool": sizing.describe(),
        "peak_gib": target.peak_gib(),
    }
    llm.shutdown()
    del llm, engine, sizing
    target.release()
    return figures


def main(
    quick: bool, model_impl: str = "auto", rounds: int = 3, target: Target | None = None
) -> None:
    """Run the preset and print the table and the JSON line.

    Args:
        quick: 2 requests of 8 output tokens instead of 32 of 64.
        model_impl: ``auto``, ``native`` or ``transformers`` (the engine's), or ``both``
            (``bench.throughput_impls``).
        rounds: Interleaved rounds for ``both``.
        target: Device, dtype and attention backend (default: CPU, float32, torch).
    """
    from bench.throughput import CPU, run_transformers
    from loraplex.engine.models.tiny_model import parameter_count

    num_requests, output_tokens = (2, 8) if quick else (32, 64)
    hf_batches = [2] if quick else [8, 16, 32]
    target = target or CPU
    torch.manual_seed(0)
    path = model_dir()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = workload(num_requests, vocab)
    shape = (
        f"model smollm-135m shape: {parameter_count(path) / 1e6:.1f}M parameters; "
        f"{num_requests} requests of 100-400 prompt tokens, {output_tokens} output tokens, "
        f"torch threads {torch.get_num_threads()}; {target.describe()}"
    )
    if model_impl == "both":
        from bench.throughput_impls import compare, fresh_tokens, report

        result = compare(
            path,
            lambda r: fresh_tokens(prompts, vocab, 1000 + r),
            output_tokens,
            rounds,
            vocab,
            decode_batches=(1,) if quick else (1, 8, 32),
            **target.engine(),
        )
        figures = report(result, shape)
        figures = {"preset": "smollm-135m", **figures, "requests": num_requests}
        figures |= {"output_tokens": output_tokens, "torch_threads": torch.get_num_threads()}
        print(json.dumps(figures | target.figures()))
        return
    sized = run_loraplex(path, prompts, output_tokens, target, model_impl=model_impl)
    old = None if quick else run_loraplex(
        path, prompts, output_tokens, target, model_impl=model_impl,
        kv_cache_memory_bytes=OLD_DEFAULT_BYTES,
    )  # fmt: skip
    hf_runs = run_transformers(path, prompts, output_tokens, hf_batches, target)
    hf = max(hf_runs, key=lambda r: r["tokens_per_s"])

    print(f"{shape}; model implementation {model_impl}")
    print(f"default flags: {sized['pool']}")
    print(f"{'system':<36}{'tok/s':>10}{'seconds':>10}{'steps':>8}{'KV GiB':>9}")
    rows = [("loraplex, default (sized) pool", sized)]
    if old is not None:
        rows.append(("loraplex, old fixed 256 MiB pool", old))
    for name, r in rows:
        print(
            f"{name:<36}{r['tokens_per_s']:>10.1f}{r['seconds']:>10.2f}{r['steps']:>8}"
            f"{r['kv_gib']:>9.2f}"
        )
    for r in hf_runs:
        name = f"transformers generate, batch {r['batch_size']}"
        print(f"{name:<36}{r['tokens_per_s']:>10.1f}{r['seconds']:>10.2f}")
    figures = {
        "preset": "smollm-135m",
        "model_impl": model_impl,
        "tokens_per_s": round(sized["tokens_per_s"], 1),
        "ratio_vs_transformers": round(sized["tokens_per_s"] / hf["tokens_per_s"], 2),
        "steps": sized["steps"],
        "kv_blocks": sized["kv_blocks"],
        "kv_gib": round(sized["kv_gib"], 3),
        "kv_rule": sized["kv_rule"],
        "transformers_tokens_per_s": round(hf["tokens_per_s"], 1),
        "transformers_batch_size": hf["batch_size"],
        "requests": num_requests,
        "output_tokens": output_tokens,
        "peak_gib": sized["peak_gib"],
        **target.figures(),
    }
    if old is not None:
        figures |= {
            "tokens_per_s_256mib_pool": round(old["tokens_per_s"], 1),
            "ratio_vs_transformers_256mib_pool": round(old["tokens_per_s"] / hf["tokens_per_s"], 2),
            "steps_256mib_pool": old["steps"],
        }
    print(json.dumps(figures))
