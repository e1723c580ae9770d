"""Benchmark: the CPU step's options side by side (issue 30 item 3).

Dense ``F.linear`` weights, oneDNN-prepacked weights (``--cpu-prepack-weights``, the default),
prepacked plus the compiled step (``--cpu-compile``), and prepacked in bfloat16.

Workload per batch size ``B`` of ``--batches``: ``B`` requests of ``--prompt`` random tokens are
prefilled (timed: prefill tokens/s), then every sequence decodes ``--steps`` tokens in pure-decode
steps (timed: ms per step). Each mode is one engine built once (the compiled one compiles at
start: reported), and the modes run in interleaved rounds (``--rounds``), best round reported,
so the machine's load hits them alike. Greedy tokens are checked equal across the float32 modes;
bfloat16 is reported with its token agreement against float32 (a different dtype is a different
model: near-ties flip).

Model: ``--preset`` (``bench.presets``; default ``smollm-135m``: SmolLM-135M's shape, 30 layers,
GQA 9/3, vocab 49,152). One torch thread unless ``--threads``.

Run: ``python -m bench.cpu_step [--quick] [--preset P] [--batches 1,8,32] [--prompt 256]
[--steps 16] [--rounds 2] [--modes dense,packed,compiled,bf16] [--threads 1]``. Prints a table,
then one JSON line. ``--quick``: the tiny preset, batches 1 and 4, 4 steps, one round.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.presets import preset_dir
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

MODES = {
    "dense": dict(cpu_prepack_weights=False),
    "packed": dict(),
    "compiled": dict(cpu_compile=True),
    "bf16": dict(dtype="bfloat16"),
}


def run_batch(llm: LLM, batch: int, prompt: int, steps: int, seed: int, vocab: int) -> dict:
    """Prefill ``batch`` random prompts, then decode ``steps`` tokens each; timings and tokens.

    Returns:
        ``{"prefill_tok_s", "decode_ms", "tokens"}`` (prefill tokens per second; mean ms per
        pure-decode step; the greedy tokens of each request).
    """
    engine = llm.engine
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    ids = [f"s{seed}-b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        tokens = torch.randint(16, vocab, (prompt,), generator=gen).tolist()
        engine.add_request(EngineRequest(rid, tokens, params))
    out: dict[str, list[int]] = {rid: [] for rid in ids}

    def step() -> None:
        for o in engine.step():
            out[o.request_id] = list(o.outputs[0].token_ids)

    start = time.perf_counter()
    while any(not t for t in out.values()):
        step()
    prefill = time.perf_counter() - start
    start, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        step()
        n += 1
    decode = time.perf_counter() - start
    return {
        "prefill_tok_s": batch * prompt / prefill,
        "decode_ms": 1e3 * decode / max(n, 1),
        "tokens": [out[r] for r in ids],
    }


def main() -> None:
    """Parse flags, build one engine per mode, run the rounds, print the table and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--batches", default=None)
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    preset = args.preset or ("tiny" if args.quick else "smollm-135m")
    batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,8,32")).split(",")]
    prompt = args.prompt or (32 if args.quick else 256)
    steps = args.steps or (4 if args.quick else 16)
    rounds = args.rounds or (1 if args.quick else 2)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    torch.set_num_threads(args.threads)
    model = str(preset_dir(preset))
    engines, start_s = {}, {}
    for mode in modes:
        t0 = time.perf_counter()
        engines[mode] = LLM(EngineConfig(model=model, enable_prefix_caching=False, **MODES[mode]))
        start_s[mode] = time.perf_counter() - t0
        print(f"{mode}: engine ready in {start_s[mode]:.1f} s", flush=True)
    vocab = engines[modes[0]].engine.model.vocab_size
    runs: dict[tuple[str, int], list[dict]] = {}
    for rnd in range(rounds):
        for batch in batches:
            order = modes if rnd % 2 == 0 else modes[::-1]
            for mode in order:
                runs.setdefault((mode, batch), []).append(
                    run_batch(engines[mode], batch, prompt, steps, rnd, vocab)
                )
    results: dict[str, dict] = {}
    print(f"{'mode/batch':<16}{'decode ms':>11}{'prefill tok/s':>15}{'decode x':>10}"
          f"{'prefill x':>11}{'same tokens':>13}")  # fmt: skip
    for batch in batches:
        base = runs.get((modes[0], batch))
        for mode in modes:
            rs = runs[(mode, batch)]
            row = {
                "decode_ms": min(r["decode_ms"] for r in rs),
                "prefill_tok_s": max(r["prefill_tok_s"] for r in rs),
                "same_tokens_as_" + modes[0]: all(
                    a["tokens"] == b["tokens"] for a, b in zip(rs, base, strict=True)
                ),
            }
            ref = results[f"{modes[0]}/{batch}"] if mode != modes[0] else row
            row["decode_x"] = ref["decode_ms"] / row["decode_ms"]
            row["prefill_x"] = row["prefill_tok_s"] / ref["prefill_tok_s"]
            results[f"{mode}/{batch}"] = row
            print(f"{mode + '/' + str(batch):<16}{row['decode_ms']:>11.1f}"
                  f"{row['prefill_tok_s']:>15.0f}{row['decode_x']:>9.2f}x{row['prefill_x']:>10.2f}x"
                  f"{str(row['same_tokens_as_' + modes[0]]):>13}")  # fmt: skip
    summary = {
        "bench": "cpu_step",
        "preset": preset,
        "threads": args.threads,
        "prompt": prompt,
        "steps": steps,
        "rounds": rounds,
        "engine_start_s": start_s,
        "compile_s": {
            m: e.engine.runner.compiled_step.compile_seconds
            for m, e in engines.items()
            if e.engine.runner.compiled_step is not None
        },
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
