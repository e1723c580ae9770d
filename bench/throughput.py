"""Benchmark: offline throughput of loraplex against transformers ``generate`` (same run).

Workload (issue 3): 64 requests, prompts of 64-512 tokens, 64 output tokens each (EOS ignored),
a shared 256-token system prompt on half of them, greedy, on the ``bench`` preset of the
built-in text-only model (about 26M parameters). loraplex runs them as one continuous batch;
transformers runs them as a transformers user would: left-padded batches through
``generate``. Also reported: the engine's own overhead (share of step time outside the model's
forward pass), and KV memory waste (slots allocated but not holding a token, over slots
allocated, averaged over steps), with the prefix cache on and off.

Run: ``python -m bench.throughput [--quick] [--preset smollm-135m|bench|llama-1b|tiny]
[--model-impl auto|native|transformers|both] [--rounds N] [--threads N] [--device cpu|cuda]
[--dtype D] [--attention-backend torch|triton] [--requests N] [--tokens N]``. Prints a table,
then one JSON line. The default preset on CPU, ``smollm-135m``, is the real 135M checkpoint's
shape (30 layers, GQA, a 49k vocabulary) with the engine's default flags
(``bench.throughput_smollm``); ``--preset bench`` runs the older 8-layer workload described
above, ``tiny`` the same workload on the built-in tiny model (smoke runs). ``--model-impl`` is
the engine's (``auto``: the native model); ``both`` serves the model with the native code and
with the transformers backend and compares them in ``--rounds`` interleaved rounds
(``bench.throughput_impls``) instead of against ``generate``.

On a GPU (``--device cuda``, ``bench.device``; bfloat16 unless ``--dtype`` says otherwise) the
default preset is ``llama-1b`` (a 1.05B Llama-3.2-1B-like shape, random weights,
``bench.presets``) with the workload above at 128 requests, and ``generate`` runs in batches
of 32 and 64 on the same GPU in the same dtype. Before the timed run the engine runs the whole
workload once with new token ids (so the prefix cache holds none of the timed prompts) and 4
output tokens: the Triton kernels' compilations and the allocator's growth land there, not in
the figures. Peak GPU memory (``torch.cuda.max_memory_allocated``) is reported per system.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.device import Target, add_arguments, target_from_args
from bench.presets import preset_dir
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

SYSTEM_TOKENS = 256
CPU = Target(torch.device("cpu"), "float32")


def model_dir() -> Path:
    """The bench-preset text model, written once into the data directory."""
    return preset_dir("bench")


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


def engine_flags(num_requests: int, caching: bool, output_tokens: int = 64) -> dict:
    """The bench preset's ``EngineConfig`` fields.

    The pool has 4,096 blocks, more when every request's longest prompt (512) and its outputs
    need more.
    """
    blocks = num_requests * -(-(512 + output_tokens) // 16) + 64
    return {
        "max_num_seqs": num_requests,
        "max_num_batched_tokens": 4096,
        "num_kv_blocks": max(4096, blocks),
        "enable_prefix_caching": caching,
    }


def warm_up(llm: LLM, prompts: list[list[int]], target: Target, vocab: int) -> None:
    """Warm the engine up, not timed.

    On CPU one short request; on CUDA the whole workload with new ids and 4 output tokens
    (Triton compilations, the allocator's growth), which the prefix cache then does not hit.
    """
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    if not target.is_cuda:
        llm.generate([EngineRequest("warm", prompts[0][:32], warm)])
        return
    from bench.throughput_impls import fresh_tokens

    fresh = fresh_tokens(prompts, vocab, seed=4242)
    llm.generate([EngineRequest(f"warm{i}", p, warm) for i, p in enumerate(fresh)])


def run_loraplex(
    path: Path,
    prompts,
    output_tokens: int,
    caching: bool,
    model_impl: str = "auto",
    target: Target = CPU,
) -> dict[str, float]:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    flags = engine_flags(len(prompts), caching, output_tokens)
    llm = LLM(EngineConfig(model=str(path), model_impl=model_impl, **flags, **target.engine()))
    engine = llm.engine
    warm_up(llm, prompts, target, vocab)
    engine.step_stats.reset()
    target.reset_peak()
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", list(p), params))
    allocated = held = 0
    target.sync()
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished_requests():
        a, h = kv_waste(engine)
        allocated += a
        held += h
        for out in engine.step():
            if out.finished:
                produced += out.outputs[0].num_tokens  # running total (DELTA outputs)
    target.sync()
    elapsed = time.perf_counter() - t0
    step = engine.step_stats.step_seconds
    forward = engine.step_stats.forward_seconds
    steps = engine.step_stats.num_steps
    hit_rate = engine.kv.stats.hit_rate()
    llm.shutdown()
    del llm, engine
    peak = target.peak_gib()
    target.release()
    return {
        "tokens_per_s": produced / elapsed,
        "seconds": elapsed,
        "overhead_fraction": 1 - forward / step,
        "kv_waste_fraction": 1 - held / allocated if allocated else 0.0,
        "steps": steps,
        "hit_rate": hit_rate,
        "peak_gib": peak,
    }


def padded_generate(model, batch: list[list[int]], output_tokens: int, pad: int) -> int:
    """Transformers ``generate`` over one left-padded batch, greedy, exactly ``output_tokens``.

    The batch is built on the CPU and moved to the model's device (its first parameter's).

    Returns:
        Tokens generated per row.
    """
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, p in enumerate(batch):  # left padding, as for decoder-only generation
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
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


def run_transformers(
    path: Path, prompts, output_tokens: int, batch_sizes: list[int], target: Target = CPU
) -> list[dict]:
    """Transformers' ``generate`` over the prompts in left-padded batches of each size.

    The model is loaded once, on ``target``'s device in its dtype.

    Returns:
        One result per batch size: tok/s, seconds, the batch size, peak GiB (CUDA).
    """
    model = target.hf_model(path)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate(batch):
        return padded_generate(model, batch, output_tokens, pad)

    generate(prompts[:2])  # warm-up
    runs = []
    for batch_size in batch_sizes:
        target.reset_peak()
        target.sync()
        t0 = time.perf_counter()
        produced = 0
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            produced += generate(batch) * len(batch)
        target.sync()
        elapsed = time.perf_counter() - t0
        runs.append(
            {
                "tokens_per_s": produced / elapsed,
                "seconds": elapsed,
                "batch_size": batch_size,
                "peak_gib": target.peak_gib(),
            }
        )
    model = None  # the closure's cell too: freed before the release
    target.release()
    return runs


def sizes(preset: str, quick: bool, cuda: bool) -> tuple[int, int, list[int]]:
    """(requests, output tokens, ``generate`` batch sizes) of a non-smollm preset's run."""
    if quick:
        return 16, 16, [16]
    if cuda:
        return 128, 64, [32, 64]
    return 64, 64, [8, 16, 32]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and tokens (< 60 s)")
    parser.add_argument(
        "--preset",
        choices=["smollm-135m", "bench", "llama-1b", "tiny"],
        default=None,
        help="smollm-135m: SmolLM-135M's shape, 32 requests of 100-400 tokens, default engine "
        "flags (the default on cpu); bench: the 26M 8-layer model, 64 requests; llama-1b: a "
        "1.05B Llama shape, 128 requests (the default on cuda); tiny: the built-in tiny model",
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
    parser.add_argument("--requests", type=int, help="requests (default: the preset's)")
    parser.add_argument("--tokens", type=int, help="output tokens each (default: the preset's)")
    add_arguments(parser)
    args = parser.parse_args()
    target = target_from_args(parser, args)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    preset = args.preset or ("llama-1b" if target.is_cuda else "smollm-135m")
    if preset == "smollm-135m":
        if args.requests or args.tokens:
            parser.error("--requests and --tokens are for the other presets")
        from bench import throughput_smollm

        throughput_smollm.main(args.quick, args.model_impl, rounds, target)
        return
    num_requests, output_tokens, hf_batches = sizes(preset, args.quick, target.is_cuda)
    num_requests, output_tokens = args.requests or num_requests, args.tokens or output_tokens
    torch.manual_seed(0)
    path = preset_dir(preset)
    from loraplex.engine.models.tiny_model import parameter_count

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = workload(num_requests, vocab)
    header = (
        f"model {path.name}: {parameter_count(path) / 1e6:.1f}M parameters; "
        f"{num_requests} requests, {output_tokens} output tokens, torch threads "
        f"{torch.get_num_threads()}; {target.describe()}"
    )
    if args.model_impl == "both":
        from bench.throughput_impls import compare, report

        flags = engine_flags(num_requests, caching=True, output_tokens=output_tokens)
        result = compare(
            path,
            lambda r: workload(num_requests, vocab, 1000 + r),
            output_tokens,
            rounds,
            vocab,
            decode_batches=(1,) if args.quick else (1, 8, 32),
            **flags,
            **target.engine(),
        )
        figures = {"preset": preset, **report(result, header), "requests": num_requests}
        figures |= {"output_tokens": output_tokens, "torch_threads": torch.get_num_threads()}
        print(json.dumps(figures | target.figures()))
        return
    impl = args.model_impl
    on = run_loraplex(path, prompts, output_tokens, caching=True, model_impl=impl, target=target)
    off = run_loraplex(path, prompts, output_tokens, caching=False, model_impl=impl, target=target)
    hf_runs = run_transformers(path, prompts, output_tokens, hf_batches, target)
    hf = max(hf_runs, key=lambda r: r["tokens_per_s"])

    print(f"{header}; model implementation {args.model_impl}")
    print(
        f"{'system':<34}{'tok/s':>10}{'seconds':>10}{'overhead':>10}{'kv waste':>10}"
        f"{'peak GiB':>10}"
    )
    for name, r in (("loraplex, prefix cache on", on), ("loraplex, prefix cache off", off)):
        print(
            f"{name:<34}{r['tokens_per_s']:>10.1f}{r['seconds']:>10.2f}"
            f"{r['overhead_fraction']:>10.3f}{r['kv_waste_fraction']:>10.3f}"
            f"{_gib(r['peak_gib']):>10}"
        )
    for r in hf_runs:
        name = f"transformers generate, batch {r['batch_size']}"
        print(f"{name:<34}{r['tokens_per_s']:>10.1f}{r['seconds']:>10.2f}{'':>20}"
              f"{_gib(r['peak_gib']):>10}")  # fmt: skip
    print(
        json.dumps(
            {
                "preset": preset,
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
                "transformers_tokens_per_s_by_batch": {
                    str(r["batch_size"]): round(r["tokens_per_s"], 1) for r in hf_runs
                },
                "peak_gib": on["peak_gib"],
                "transformers_peak_gib": hf["peak_gib"],
                "requests": num_requests,
                "output_tokens": output_tokens,
                **target.figures(),
            }
        )
    )


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
