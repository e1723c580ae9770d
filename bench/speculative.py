"""Benchmark: speculative decoding against plain decoding, same run (issue 17 item 4).

Model: the built-in text model with SmolLM-135M's shape (30 layers, GQA 9/3, a 49k vocabulary,
random weights; ``bench.throughput_smollm``), CPU, float32, one continuous batch of
``--requests`` requests of 64-192 random prompt tokens, ``ignore_eos``. Random weights know no
language, so the workloads are what such a model does:

(a) **repeating**: greedy. The random-weight model with tied embeddings predicts its last
    token again (its logits are ``h . E`` with ``h`` close to that token's embedding), so its
    output repeats one token or a short cycle, as an output that quotes or edits its input
    repeats it: the case prompt lookup is for, at the top of its acceptance. (Asking the model
    to repeat an earlier output does not work with random weights: its continuation of
    ``P + C + P`` is not ``C``.) The figure is the speedup when proposals are right, not a
    claim about real text, where acceptance is lower.
(b) **non-repeating**: sampled at temperature 20 with a seed, where that model's output
    repeats neither its prompt nor itself (at temperature 10 it still repeats 89% of the
    time): n-gram lookup finds next to nothing and the draft's proposals are wrong, so what is
    measured is what speculation costs when it cannot help, which the adaptive proposal count
    must keep within a few percent.
(c) **draft model**: both workloads with a 4-layer draft cut from the same checkpoint
    (``engine.spec_decode.layer_skip``: its first 4 layers, embeddings, norm and head).

Each configuration's outputs are checked to be token for token those of plain decoding.
Reported per run: output tokens/s and its ratio to plain decoding of the same workload
(rounds interleaved, best of each), steps, acceptance rate (accepted over verified
proposals) and mean accepted length (tokens a verification step produces: 1 + accepted /
verifications). Targets: (a) n-gram >= 1.8x, (b) n-gram >= 0.97x.

Run: ``python -m bench.speculative [--quick] [--requests N] [--tokens N] [--k K] [--rounds N]
[--preset P] [--device cpu|cuda] [--dtype D] [--attention-backend torch|triton]``. Prints a
table, then one JSON line. ``--quick`` runs the 8-layer ``bench`` preset, 4 requests of 24
tokens, one round.

On a GPU (``--device cuda``, ``bench.device``: bfloat16 unless ``--dtype`` says otherwise) the
default target is the ``llama-1b`` preset (1.05B parameters, tied embeddings, so the
repeating workload repeats as above; ``bench.presets``) and its draft its first 4 layers: a
decode step of a few sequences there reads 2 GB of weights, so verifying k + 1 positions
costs about what one does, which is what speculation buys. The three engines live together
on the device; each engine's warm-up runs both workloads' shapes (Triton compilations), and
every timed run is bracketed by ``torch.cuda.synchronize``. In bfloat16 the outputs of a
verification step (k + 1 positions in one forward) may differ from plain decoding's
one-position steps where two logits nearly tie (different kernels, different rounding), and
on a GPU cuBLAS may pick other algorithms for k + 1 rows than for 1 even in float32: the
equality check, an assertion on CPU in float32, is elsewhere a count of requests whose outputs
differ, reported as ``outputs_differ`` (the speedups are still measured on the same work).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.device import add_arguments, target_from_args
from bench.presets import PRESETS, preset_dir
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest, RequestOutputKind
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.spec_decode.layer_skip import write_layer_skip_draft

DRAFT_LAYERS = 4


def target_dir(quick: bool, preset: str | None = None) -> Path:
    """The benchmark's target checkpoint, written once into the data directory.

    ``preset``, else ``bench`` with ``quick``, else ``smollm-135m`` (``bench.presets``).
    """
    return preset_dir(preset or ("bench" if quick else "smollm-135m"))


def draft_dir(target: Path) -> Path:
    """The layer-skip draft of ``target`` (written once next to it)."""
    out = target.parent / f"{target.name}-draft{DRAFT_LAYERS}"
    if not (out / "config.json").exists():
        write_layer_skip_draft(target, out, DRAFT_LAYERS)
    return out


def random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of 64-192 random token ids (past the special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 193, (n,), generator=gen).tolist()
    return [torch.randint(16, vocab, (m,), generator=gen).tolist() for m in lengths]


def run(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], tag: str, target=None
) -> dict:
    """One continuous batch; tokens/s, steps, the outputs and the acceptance counters.

    ``target`` (a ``bench.device.Target``) synchronises the device around the timing.
    """
    sync = target.sync if target is not None else (lambda: None)
    engine = llm.engine
    before = engine.stats()
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(
            EngineRequest(f"{tag}-{i}", list(prompt), sp, output_kind=RequestOutputKind.FINAL_ONLY)
        )
    outputs: dict[int, list[int]] = {}
    steps = 0
    sync()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id.rsplit("-", 1)[1])] = out.outputs[0].token_ids
    sync()
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    delta = {
        k: after[k] - before[k]
        for k in (
            "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens",
        )  # fmt: skip
    }
    produced = sum(len(t) for t in outputs.values())
    drafts, proposed = delta["spec_decode_num_drafts"], delta["spec_decode_num_draft_tokens"]
    accepted = delta["spec_decode_num_accepted_tokens"]
    return {
        "tokens_per_s": produced / elapsed,
        "seconds": elapsed,
        "tokens": produced,
        "steps": steps,
        "verifications": drafts,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
        "outputs": [outputs[i] for i in range(len(prompts))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bench preset, 4 x 24 tokens")
    parser.add_argument("--requests", type=int, default=None, help="requests per batch (8)")
    parser.add_argument("--tokens", type=int, default=None, help="output tokens each (96)")
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens (4)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (3; 1 with --quick)")
    parser.add_argument(
        "--preset",
        choices=PRESETS,
        help="the target model (default: bench with --quick, llama-1b on cuda, else smollm-135m)",
    )
    add_arguments(parser)
    args = parser.parse_args()
    device = target_from_args(parser, args)
    num, tokens = (4, 24) if args.quick else (8, 96)
    num, tokens = args.requests or num, args.tokens or tokens
    rounds = args.rounds or (1 if args.quick else 3)
    exact = device.dtype == "float32" and not device.is_cuda
    torch.manual_seed(0)
    preset = args.preset or ("llama-1b" if device.is_cuda and not args.quick else None)
    target = target_dir(args.quick, preset)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    blocks = max(1024, num * -(-(192 + tokens + 2 * args.k + 16) // 16))
    base = {"model": str(target), "max_num_seqs": num, "num_kv_blocks": blocks}
    base |= device.engine()
    spec = {"num_speculative_tokens": args.k}
    draft = {"speculative_model": str(draft_dir(target))}
    engines = {
        "plain": LLM(EngineConfig(**base)),
        "ngram": LLM(EngineConfig(**base, **spec, speculative_method="ngram")),
        "draft": LLM(EngineConfig(**base, **spec, **draft, speculative_method="draft")),
    }
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    warm = random_prompts(2, vocab, seed=0)
    for name, llm in engines.items():  # warm-up, not timed
        run(llm, warm, [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 2, name)
    if device.is_cuda:  # both workloads' batch shapes too: Triton compiles per shape class
        hot = random_prompts(num, vocab, seed=3)
        for name, llm in engines.items():
            greedy8 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            run(llm, hot, [greedy8] * num, f"hot-{name}")
            hot_params = [
                SamplingParams(temperature=20.0, seed=i, max_tokens=16, ignore_eos=True)
                for i in range(num)
            ]
            run(llm, hot, hot_params, f"hot2-{name}")
    device.reset_peak()
    workloads = {
        "repeating": (random_prompts(num, vocab, seed=1), [greedy] * num),
        "non-repeating": (random_prompts(num, vocab, seed=2),
                          [SamplingParams(temperature=20.0, seed=i, max_tokens=tokens,
                                          ignore_eos=True) for i in range(num)]),
    }  # fmt: skip
    results: dict[str, dict[str, dict]] = {w: {} for w in workloads}
    for r in range(rounds):
        for wname, (prompts, params) in workloads.items():
            for ename, llm in engines.items():
                res = run(llm, prompts, params, f"{wname}-{ename}-{r}", device)
                best = results[wname].get(ename)
                if best is None or res["tokens_per_s"] > best["tokens_per_s"]:
                    results[wname][ename] = res
    print(f"model {target.name}; draft: its first {DRAFT_LAYERS} layers; {num} requests x "
          f"{tokens} tokens; k <= {args.k}; best of {rounds}; {device.describe()}")  # fmt: skip
    print(f"{'workload':<15}{'method':<7}{'tok/s':>9}{'x plain':>9}{'steps':>7}"
          f"{'accept':>8}{'mean len':>9}")  # fmt: skip
    summary = {}
    for wname, by_engine in results.items():
        plain = by_engine["plain"]
        for ename, res in by_engine.items():
            differ = sum(a != b for a, b in zip(res["outputs"], plain["outputs"], strict=True))
            if exact:  # CPU float32: token for token (docs/speculative.md); else counted
                assert differ == 0, f"{wname}/{ename}: outputs differ"
            ratio = res["tokens_per_s"] / plain["tokens_per_s"]
            print(f"{wname:<15}{ename:<7}{res['tokens_per_s']:>9.1f}{ratio:>9.2f}"
                  f"{res['steps']:>7}{res['acceptance_rate']:>8.2f}"
                  f"{res['mean_accepted_length']:>9.2f}")  # fmt: skip
            summary[f"{wname}/{ename}"] = {
                **{k: v for k, v in res.items() if k != "outputs"},
                "ratio_to_plain": ratio,
                "outputs_differ": differ,
            }
    print("targets: repeating/ngram >= 1.8x, non-repeating/ngram >= 0.97x")
    print(json.dumps({"bench": "speculative", "model": target.name, "requests": num,
                      "tokens": tokens, "k": args.k, "rounds": rounds, "results": summary,
                      "peak_gib": device.peak_gib(), **device.figures()}))  # fmt: skip


if __name__ == "__main__":
    main()
