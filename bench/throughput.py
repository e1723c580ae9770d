"""Benchmark: offline throughput of loraplex against transformers ``generate`` (same run).

Workload (issue 3): 64 requests, prompts of 64-512 tokens, 64 output tokens each (EOS ignored),
a shared 256-token system prompt on half of them, greedy, on the ``bench`` preset of the
built-in text-only model (about 26M parameters). loraplex runs them as one continuous batch;
transformers runs them as a transformers user would: left-padded batches through
``generate``. Also reported: the engine's own overhead (share of step time outside the model's
forward pass), and KV memory waste (slots allocated but not holding a token, over slots
allocated, averaged over steps), with the prefix cache on and off.

Run: ``python -m bench.throughput [--quick] [--preset smollm-135m|bench]
[--model-impl auto|native|transformers|both] [--rounds N] [--threads N]``. Prints a table, then
one JSON line. The default preset, ``smollm-135m``, is the real 135M checkpoint's shape (30
layers, GQA, a 49k vocabulary) with the engine's default flags (``bench.throughput_smollm``);
``--preset bench`` runs the older 8-layer workload described above. ``--model-impl`` is the
engine's (``auto``: the native model); ``both`` serves the model with the native code and with
the transformers backend and compares them in ``--rounds`` interleaved rounds
(``bench.throughput_impls``) instead of against ``generate``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.gateway.settings import data_dir

SYSTEM_TOKENS = 256


def model_dir() -> Path:
    """The bench-preset text model, written once into the data directory."""
    from loraplex.engine.models.tiny_model import init_tiny

    target = data_dir() / "bench" / "tiny-text-bench"
    if not (target / "config.json").exists():
        init_tiny(target, seed=0, text_only=True, preset="bench")
    return target


def workload(num_requests: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 64-512 tokens; every other one starts with the shared system prompt."""
    gen = torch.Generator().manual_seed(seed)
    low = 16  # skip the special tokens
    system = torch.randint(low, vocab, (SYSTEM_TOKENS,), generator=gen).tolist()
    prompts = []
    for i in range(num_requests):
        length = int(torch.randint(64, 513, (1,), generator=gen))
        if i % 2 == 0 and length > SYSTEM_TOKENS:
            unique = torch.randint(low, vocab, (length - SYSTEM_TOKENS,), generator=gen).tolist()
            prompts.append(system + unique)
        else:
            prompts.append(torch.randint(low, vocab, (length,), generator=gen).tolist())
    return prompts


def kv_waste(engine) -> tuple[int, int]:
    """(allocated slots, slots holding a token) of the pool now; shared blocks count once."""
    bs = engine.kv.block_size
    filled: dict[int, int] = {}
    for seq in engine.scheduler.running:
        for j, block in enumerate(engine.kv.get_block_ids(seq.seq_id)):
            held = max(0, min(bs, seq.num_computed_tokens - j * bs))
            filled[block] = max(filled.get(block, 0), held)
    return engine.kv.pool.num_used * bs, sum(filled.values())


def engine_flags(num_requests: int, caching: bool) -> dict:
    """The bench preset's ``EngineConfig`` fields."""
    return {
        "max_num_seqs": num_requests,
        "max_num_batched_tokens": 4096,
        "num_kv_blocks": 4096,
        "enable_prefix_caching": caching,
    }


def run_loraplex(
    path: Path, prompts, output_tokens: int, caching: bool, model_impl: str = "auto"
) -> dict[str, float]:
    llm = LLM(
        EngineConfig(model=str(path), model_impl=model_impl, **engine_flags(len(prompts), caching))
    )
    engine = llm.engine
    # Warm-up (allocator, kernels), not timed.
    llm.generate(
        [
            EngineRequest(
                "warm",
                prompts[0][:32],
                SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            )
        ]
    )
    engine.step_stats.reset()
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", list(p), params))
    allocated = held = 0
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished_requests():
        a, h = kv_waste(engine)
        allocated += a
        held += h
        for out in engine.step():
            if out.finished:
                produced += out.outputs[0].num_tokens  # running total (DELTA outputs)
    elapsed = time.perf_counter() - t0
    step = engine.step_stats.step_seconds
    forward = engine.step_stats.forward_seconds
    return {
        "tokens_per_s": produced / elapsed,
        "seconds": elapsed,
        "overhead_fraction": 1 - forward / step,
        "kv_waste_fraction": 1 - held / allocated if allocated else 0.0,
        "steps": engine.step_stats.num_steps,
        "hit_rate": engine.kv.stats.hit_rate(),
    }


def padded_generate(model, batch: list[list[int]], output_tokens: int, pad: int) -> int:
    """Transformers ``generate`` over one left-padded batch, greedy, exactly ``output_tokens``.

    Returns:
        Tokens generated per row.
    """
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, p in enumerate(batch):  # left padding, as for decoder-only generation
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=output_tokens,
            min_new_tokens=output_tokens,
            pad_token_id=pad,
        )
    return out.shape[1] - width


def run_transformers(path: Path, prompts, output_tokens: int, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate(batch):
        return padded_generate(model, batch, output_tokens, pad)

    generate(prompts[:2])  # warm-up
    t0 = time.perf_counter()
    produced = 0
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        produced += generate(batch) * len(batch)
    elapsed = time.perf_counter() - t0
    return {"tokens_per_s": produced / elapsed, "seconds": elapsed, "batch_size": batch_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and tokens (< 60 s)")
    parser.add_argument(
        "--preset",
        choices=["smollm-135m", "bench"],
        default="smollm-135m",
        help="smollm-135m: SmolLM-135M's shape, 32 requests of 100-400 tokens, default engine "
        "flags (default); bench: the 26M 8-layer model, 64 requests",
    )
    parser.add_argument(
        "--model-impl",
        choices=["auto", "native", "transformers", "both"],
        default="auto",
        help="the engine's model implementation (auto: native where one exists); both: native "
        "and the transformers backend in interleaved rounds, compared with each other",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds for --model-impl both"
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    if args.preset == "smollm-135m":
        from bench import throughput_smollm

        throughput_smollm.main(args.quick, args.model_impl, rounds)
        return
    num_requests, output_tokens = (16, 16) if args.quick else (64, 64)
    hf_batches = [16] if args.quick else [8, 16, 32]
    torch.manual_seed(0)
    path = model_dir()
    from loraplex.engine.models.tiny_model import parameter_count

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = workload(num_requests, vocab)
    header = (
        f"model {path.name}: {parameter_count(path) / 1e6:.1f}M parameters; "
        f"{num_requests} requests, {output_tokens} output tokens, torch threads "
        f"{torch.get_num_threads()}"
    )
    if args.model_impl == "both":
        from bench.throughput_impls import compare, report

        flags = engine_flags(num_requests, caching=True)
        result = compare(
            path,
            lambda r: workload(num_requests, vocab, 1000 + r),
            output_tokens,
            rounds,
            vocab,
            decode_batches=(1,) if args.quick else (1, 8, 32),
            **flags,
        )
        figures = {"preset": "bench", **report(result, header), "requests": num_requests}
        figures |= {"output_tokens": output_tokens, "torch_threads": torch.get_num_threads()}
        print(json.dumps(figures))
        return
    on = run_loraplex(path, prompts, output_tokens, caching=True, model_impl=args.model_impl)
    off = run_loraplex(path, prompts, output_tokens, caching=False, model_impl=args.model_impl)
    hf_runs = [run_transformers(path, prompts, output_tokens, b) for b in hf_batches]
    hf = max(hf_runs, key=lambda r: r["tokens_per_s"])

    print(f"{header}; model implementation {args.model_impl}")
    print(f"{'system':<34}{'tok/s':>10}{'seconds':>10}{'overhead':>10}{'kv waste':>10}")
    print(
        f"{'loraplex, prefix cache on':<34}{on['tokens_per_s']:>10.1f}{on['seconds']:>10.2f}"
        f"{on['overhead_fraction']:>10.3f}{on['kv_waste_fraction']:>10.3f}"
    )
    print(
        f"{'loraplex, prefix cache off':<34}{off['tokens_per_s']:>10.1f}{off['seconds']:>10.2f}"
        f"{off['overhead_fraction']:>10.3f}{off['kv_waste_fraction']:>10.3f}"
    )
    for r in hf_runs:
        name = f"transformers generate, batch {r['batch_size']}"
        print(f"{name:<34}{r['tokens_per_s']:>10.1f}{r['seconds']:>10.2f}")
    print(
        json.dumps(
            {
                "model_impl": args.model_impl,
                "tokens_per_s": round(on["tokens_per_s"], 1),
                "ratio_vs_transformers": round(on["tokens_per_s"] / hf["tokens_per_s"], 2),
                "overhead_fraction": round(on["overhead_fraction"], 3),
                "kv_waste_fraction": round(on["kv_waste_fraction"], 4),
                "prefix_hit_rate": round(on["hit_rate"], 3),
                "tokens_per_s_no_prefix_cache": round(off["tokens_per_s"], 1),
                "ratio_vs_transformers_no_prefix_cache": round(
                    off["tokens_per_s"] / hf["tokens_per_s"], 2
                ),
                "overhead_fraction_no_prefix_cache": round(off["overhead_fraction"], 3),
                "kv_waste_fraction_no_prefix_cache": round(off["kv_waste_fraction"], 4),
                "transformers_tokens_per_s": round(hf["tokens_per_s"], 1),
                "transformers_batch_size": hf["batch_size"],
                "requests": num_requests,
                "output_tokens": output_tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
