"""Benchmark: decode step time with CUDA graphs against eager steps (issue 34 item 3).

Workload: ``B`` requests of ``--prompt`` random tokens are prefilled, then ``--steps`` pure-decode
steps of all ``B`` sequences are timed (``EngineCore.step_stats``, reset after the prefill and
one warm decode step), for each batch size of ``--batches``, once with ``--enforce-eager`` and
once with CUDA graphs, on the same engine configuration. Models (``bench.presets``, written
once into the data directory): ``tiny`` (the built-in tiny text Llama) and ``llama-1b`` (a
Llama-3.2-1B-like random-weight model: hidden 2048, 16 layers, GQA 32/8, MLP 8192; 1.05B
parameters). On CUDA the Triton attention backend runs (graphs need it) in ``--dtype``; on the CPU
graphs are never used: the bench says so and reports eager figures only.

Reported per (model, batch, mode): mean step time (ms), mean forward time (the model forward and
logits, ms), the engine's host overhead per step (step minus forward) as a share of the step,
the steps that replayed a graph, and the graphs' step-time gain (eager over graphs). The greedy
tokens of the timed steps are checked to be the same in both modes (float32 only: in bfloat16 a
different split-KV count may flip a near-tie).

Run: ``python -m bench.cuda_graphs [--device cuda] [--quick] [--models tiny,llama-1b]
[--batches 1,8,32,64] [--steps N] [--prompt N] [--dtype bfloat16]``. Prints a table, then one
JSON line. ``--quick``: the tiny model, batches 1 and 4, 4 steps.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.presets import preset_dir
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

MODELS = ("tiny", "llama-1b")


def decode_steps(llm: LLM, batch: int, prompt: int, steps: int, seed: int) -> dict:
    """Prefill ``batch`` requests, then time ``steps`` decode steps of all of them."""
    engine = llm.engine
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(
            EngineRequest(rid, torch.randint(16, 200, (prompt,), generator=gen).tolist(), params)
        )
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)

    while any(not t for t in tokens.values()):  # every prompt prefilled (first token out)
        step()
    step()  # one decode step of the whole batch, untimed
    graphs = engine.runner.decode_graphs
    replays = graphs.replays if graphs is not None else 0
    engine.step_stats.reset()
    for _ in range(steps):
        step()
    stats = engine.step_stats
    step_ms = 1e3 * stats.step_seconds / stats.num_steps
    forward_ms = 1e3 * stats.forward_seconds / stats.num_steps
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "step_ms": step_ms,
        "forward_ms": forward_ms,
        "host_overhead_share": max(0.0, 1 - forward_ms / step_ms),
        "graph_replays": (graphs.replays if graphs is not None else 0) - replays,
        "steps": stats.num_steps,
        "tokens": [tokens[rid] for rid in ids],
    }


def run_model(name: str, args, modes: list[str]) -> dict:
    """Every batch size in every mode for one model; one engine per mode."""
    rows: dict[str, dict] = {}
    for mode in modes:
        config = EngineConfig(
            model=str(preset_dir(name)),
            device=args.device,
            dtype=args.dtype,
            attention_backend="triton" if args.device == "cuda" else "torch",
            max_num_seqs=max(args.batches),
            max_num_batched_tokens=max(2048, max(args.batches) * args.prompt),
            enforce_eager=mode == "eager",
            enable_prefix_caching=False,
            **({"kv_cache_memory_bytes": 4 << 30} if args.device == "cuda" else {}),
        )
        llm = LLM(config)
        graphs = llm.engine.runner.decode_graphs
        capture = (
            {"capture_s": round(graphs.capture_seconds, 2),
             "capture_mib": round(graphs.capture_bytes / 2**20, 1)}
            if graphs is not None else {}
        )  # fmt: skip
        for batch in args.batches:
            row = decode_steps(llm, batch, args.prompt, args.steps, seed=batch)
            rows[f"{name}/b{batch}/{mode}"] = {**row, **capture}
        llm.shutdown()
    return rows


def main() -> None:
    """Parse flags, run every model, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default=None, help="comma-separated: tiny, llama-1b")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, else float32")
    args = parser.parse_args()
    args.models = (args.models or ("tiny" if args.quick else ",".join(MODELS))).split(",")
    args.batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,8,32,64"))
                    .split(",")]  # fmt: skip
    args.steps = args.steps or (4 if args.quick else 50)
    args.prompt = 16 if args.quick else args.prompt
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    modes = ["eager", "graphs"] if args.device == "cuda" else ["eager"]
    if args.device != "cuda":
        print("CPU: CUDA graphs are never used on the CPU; eager figures only")
    results: dict[str, dict] = {}
    for name in args.models:
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}: {' or '.join(MODELS)}")
        results.update(run_model(name, args, modes))
    print(f"{'model/batch/mode':<24}{'step ms':>10}{'fwd ms':>10}{'host %':>8}{'replays':>9}"
          f"{'gain':>7}")  # fmt: skip
    for key, row in results.items():
        gain = ""
        if key.endswith("/graphs"):
            eager = results[key.removesuffix("graphs") + "eager"]
            row["gain"] = eager["step_ms"] / row["step_ms"]
            row["same_tokens"] = eager["tokens"] == row["tokens"]
            gain = f"{row['gain']:.2f}x"
        share = 100 * row["host_overhead_share"]
        print(f"{key:<24}{row['step_ms']:>10.3f}{row['forward_ms']:>10.3f}"
              f"{share:>7.1f}%{row['graph_replays']:>9}{gain:>7}")  # fmt: skip
    for row in results.values():
        row.pop("tokens")
    summary = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "graphs": args.device == "cuda",
        "steps": args.steps,
        "prompt": args.prompt,
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
