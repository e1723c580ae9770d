"""``bench.throughput --model-impl both``: the transformers backend against the native model.

The same checkpoint served twice in one process: ``LLM(EngineConfig(model_impl="native"))``
(the engine's own Llama code) and ``LLM(EngineConfig(model_impl="transformers"))``
(transformers' ``LlamaForCausalLM`` over the same paged KV cache, ``engine.models.
transformers_backend``), both with the preset's engine flags. Rounds are interleaved and the
order alternates (round 0: native then transformers, round 1: transformers then native, ...),
so a machine getting busier or quieter during the run weighs on both alike; each round's ratio
compares two adjacent runs. Every round draws its own prompts (the preset's workload with a
seed of its own; :func:`fresh_tokens` keeps the lengths and redraws the ids), so no round hits
the prefix cache an earlier round filled; both implementations run the same prompts in a
round. Reported: tokens/s of each implementation per round, their medians, the
transformers/native ratio per round and its median, the process CPU time of each run (native
over transformers: the same ratio in CPU time, which a busy machine disturbs less when torch
runs one thread; with more threads, threads that wait for a descheduled partner burn CPU time
too), engine steps, and whether both produced the same tokens (greedy, float32: they should,
request for request). Then decode-only steps at batch 1, 8 and 32 (:func:`decode_steps`), the
two engines stepped alternately: the per-step cost the transformers backend adds (its module
tree's Python, ``bench.backend_overhead``) weighs most there.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

IMPLS = ("native", "transformers")


def fresh_tokens(prompts: list[list[int]], vocab: int, seed: int) -> list[list[int]]:
    """Prompts of the same lengths as ``prompts`` with new random ids (above the specials)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(16, vocab, (len(p),), generator=gen).tolist() for p in prompts]


def build(path: Path, model_impl: str, **config) -> LLM:
    """An ``LLM`` of ``model_impl`` over ``path``, warmed up by one short request."""
    llm = LLM(EngineConfig(model=str(path), model_impl=model_impl, **config))
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([EngineRequest("warm", list(range(16, 48)), warm)])
    return llm


def run_round(llm: LLM, prompts: list[list[int]], output_tokens: int, tag: str) -> dict:
    """One timed ``generate`` of every prompt; tokens/s, steps, and the output token ids."""
    engine = llm.engine
    engine.step_stats.reset()
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    requests = [EngineRequest(f"{tag}-{i}", list(p), params) for i, p in enumerate(prompts)]
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = llm.generate(requests)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    stats = engine.step_stats
    return {
        "tokens_per_s": sum(len(t) for t in tokens) / elapsed,
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "steps": stats.num_steps,
        "forward_fraction": stats.forward_seconds / stats.step_seconds,
        "tokens": tokens,
    }


def compare(
    path: Path,
    prompts_of_round: Callable[[int], list[list[int]]],
    output_tokens: int,
    rounds: int,
    vocab: int,
    decode_batches: tuple[int, ...] = (1, 8, 32),
    **config,
) -> dict:
    """Interleaved rounds of both implementations (see the module docstring).

    Args:
        path: The model directory (a native architecture, else ``native`` refuses it).
        prompts_of_round: Round index -> that round's prompts (token ids).
        output_tokens: Tokens generated per request (EOS ignored).
        rounds: Rounds (each runs both implementations once).
        vocab: The model's vocabulary size (for :func:`decode_steps`' prompts).
        decode_batches: Batch sizes of the decode-only comparison run after the rounds
            (:func:`decode_steps`).
        **config: ``EngineConfig`` fields on top of the defaults, for both.

    Returns:
        ``{"rounds": [...], "native": median tok/s, "transformers": median tok/s, "ratio":
        median per-round transformers/native ratio, "token_exact": requests with equal
        outputs over requests, ...}``.
    """
    start = load()
    llms = {impl: build(path, impl, **config) for impl in IMPLS}
    per_round = []
    same = total = 0
    for r in range(rounds):
        batch = prompts_of_round(r)
        order = IMPLS if r % 2 == 0 else IMPLS[::-1]
        runs = {impl: run_round(llms[impl], batch, output_tokens, f"r{r}{impl}") for impl in order}
        pairs = zip(runs["native"]["tokens"], runs["transformers"]["tokens"], strict=True)
        same += sum(a == b for a, b in pairs)
        total += len(batch)
        per_round.append(
            {
                "order": list(order),
                **{f"{impl}_tokens_per_s": runs[impl]["tokens_per_s"] for impl in IMPLS},
                **{f"{impl}_steps": runs[impl]["steps"] for impl in IMPLS},
                **{f"{impl}_forward_fraction": runs[impl]["forward_fraction"] for impl in IMPLS},
                **{f"{impl}_cpu_seconds": runs[impl]["cpu_seconds"] for impl in IMPLS},
                "ratio": runs["transformers"]["tokens_per_s"] / runs["native"]["tokens_per_s"],
                "cpu_ratio": runs["native"]["cpu_seconds"] / runs["transformers"]["cpu_seconds"],
            }
        )
    decodes = [decode_steps(llms, b, vocab) for b in decode_batches]
    return {
        "load": f"at the start {start}; at the end {load()}",
        "decode": decodes,
        "rounds": per_round,
        "native": statistics.median(r["native_tokens_per_s"] for r in per_round),
        "transformers": statistics.median(r["transformers_tokens_per_s"] for r in per_round),
        "ratio": statistics.median(r["ratio"] for r in per_round),
        "cpu_ratio": statistics.median(r["cpu_ratio"] for r in per_round),
        "token_exact": f"{same}/{total}",
    }


def load() -> str:
    """The machine's load averages (1, 5, 15 minutes), for the record."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def decode_steps(
    llms: dict[str, LLM], batch: int, vocab: int, steps: int = 32, prompt_len: int = 100
) -> dict:
    """Decode-only steps of ``batch`` sequences, the two engines stepped alternately.

    Both engines get the same ``batch`` prompts of ``prompt_len`` random ids and run their
    prefill; then each step of one is followed by the same step of the other, ``steps``
    times (every sequence decodes one token per step). Per-step Python cost weighs most here:
    the step's matrix products are smallest.

    Returns:
        ``{"batch", "native_ms", "transformers_ms"}`` (median step times) and ``"ratio"``,
        the median over steps of native step time over transformers step time.
    """
    gen = torch.Generator().manual_seed(2000 + batch)
    prompts = torch.randint(16, vocab, (batch, prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    engines = {impl: llms[impl].engine for impl in IMPLS}
    for engine in engines.values():
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(f"decode{batch}-{i}", p, params))
        sched = engine.scheduler
        while sched.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in sched.running):
            engine.step()  # the prefills, not timed
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for _ in range(steps):
        for impl, engine in engines.items():
            t0 = time.perf_counter()
            engine.step()
            times[impl].append(time.perf_counter() - t0)
    for engine in engines.values():
        while engine.has_unfinished_requests():
            engine.step()
    pairs = zip(times["native"], times["transformers"], strict=True)
    return {
        "batch": batch,
        "native_ms": statistics.median(times["native"]) * 1e3,
        "transformers_ms": statistics.median(times["transformers"]) * 1e3,
        "ratio": statistics.median(n / t for n, t in pairs),
    }


def report(result: dict, header: str) -> dict:
    """Print the per-round table and return the JSON figures."""
    print(header)
    print(
        f"tok/s per round (transformers: the transformers backend, not generate); {result['load']}"
    )
    print(
        f"{'round':<7}{'order':<24}{'native':>8}{'transformers':>14}{'ratio':>7}"
        f"{'CPU s native':>14}{'transformers':>14}{'ratio':>7}{'steps':>9}"
    )
    for i, r in enumerate(result["rounds"]):
        order = ", ".join(r["order"])
        print(
            f"{i:<7}{order:<24}{r['native_tokens_per_s']:>8.1f}"
            f"{r['transformers_tokens_per_s']:>14.1f}{r['ratio']:>7.3f}"
            f"{r['native_cpu_seconds']:>14.1f}{r['transformers_cpu_seconds']:>14.1f}"
            f"{r['cpu_ratio']:>7.3f}{r['native_steps']:>5}/{r['transformers_steps']:<3}"
        )
    print(
        f"{'median':<31}{result['native']:>8.1f}{result['transformers']:>14.1f}"
        f"{result['ratio']:>7.3f}{'':>28}{result['cpu_ratio']:>7.3f}"
    )
    print(f"same tokens (requests): {result['token_exact']}")
    print("decode-only steps, engines stepped alternately (median ms per step)")
    print(f"{'batch':<7}{'native':>10}{'transformers':>14}{'extra ms':>10}{'ratio':>8}")
    for d in result["decode"]:
        extra = d["transformers_ms"] - d["native_ms"]
        print(
            f"{d['batch']:<7}{d['native_ms']:>10.1f}{d['transformers_ms']:>14.1f}{extra:>10.2f}"
            f"{d['ratio']:>8.3f}"
        )
    return {
        "model_impl": "both",
        "native_tokens_per_s": round(result["native"], 1),
        "transformers_tokens_per_s": round(result["transformers"], 1),
        "ratio_transformers_vs_native": round(result["ratio"], 3),
        "ratios_per_round": [round(r["ratio"], 3) for r in result["rounds"]],
        "cpu_time_ratio_native_vs_transformers": round(result["cpu_ratio"], 3),
        "cpu_time_ratios_per_round": [round(r["cpu_ratio"], 3) for r in result["rounds"]],
        "token_exact": result["token_exact"],
        "decode_step_ratios": {str(d["batch"]): round(d["ratio"], 3) for d in result["decode"]},
        "decode_step_ms": {
            str(d["batch"]): [round(d["native_ms"], 2), round(d["transformers_ms"], 2)]
            for d in result["decode"]
        },
        "rounds": len(result["rounds"]),
    }
