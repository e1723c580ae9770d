"""Benchmark: torch threads bound (``--cpu-threads-bind``) or not, at each thread count.

Workload: decode-heavy, as serving is: 8 requests of 64 random prompt tokens, 48 output tokens
each (EOS ignored), greedy, one continuous batch, on the ``smollm-135m`` preset (SmolLM-135M's
shape, random weights, float32; ``bench.presets``). For each thread count (1 and every CPU this
process may use) it runs ``nobind`` (torch's threads go where the kernel puts them) and a CPU
list (``auto``'s list cut to that many CPUs: the process bound to it and torch's OpenMP threads
pinned one per CPU), each in a fresh process bound the way an engine core process binds itself
(``engine.core.cpu_bind.bind_core_process``, before torch loads), configurations interleaved
round by round so that load from other processes falls on all of them alike.

Reported per configuration: output tokens/s in each round and their median, and the CPU
seconds the process used per wall second (above the thread count: threads spin while they
wait for each other). On a machine others use, compare medians and look at the spread.

Run: ``python -m bench.cpu_threads [--quick] [--rounds N] [--preset smollm-135m|tiny]``.
``--quick``: the built-in tiny model, 2 requests of 8 tokens, one round, the 1-thread
configurations only. Prints a table, then
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REQUESTS, PROMPT, OUTPUT = 8, 64, 48


def child(spec: dict) -> dict:
    """One configuration, in this (fresh) process: bind, load, warm up, time the workload.

    ``spec``: ``preset``, ``threads``, ``bind`` (``nobind`` or a CPU list), ``requests``,
    ``output``. torch must not be loaded yet (the binding pins its threads as it loads).
    """
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.core.cpu_bind import bind_core_process

    bound = EngineConfig(model="-", num_cpu_threads=spec["threads"], cpu_threads_bind=spec["bind"])
    unpinned = bind_core_process(bound)
    import torch

    from bench.presets import preset_dir
    from loraplex.engine.client.llm import LLM
    from loraplex.engine.request import EngineRequest
    from loraplex.engine.sampling.params import SamplingParams

    path = preset_dir(spec["preset"])
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    llm = LLM(bound.replace(model=str(path)))
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(16, vocab, (PROMPT,), generator=gen).tolist() for _ in range(spec["requests"])
    ]
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([EngineRequest("warm", prompts[0][:32], warm)])
    params = SamplingParams(temperature=0.0, max_tokens=spec["output"], ignore_eos=True)
    requests = [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = llm.generate(requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {
        "tokens_per_s": produced / wall,
        "cpu_per_wall": cpu / wall,
        "threads": torch.get_num_threads(),
        "affinity": sorted(
            set().union(*(os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")))
        ),
        "pinned": spec["bind"] != "nobind" and unpinned is None,
    }


def configurations(allowed: list[int]) -> list[dict]:
    """``nobind`` and a bound list, at 1 thread and at one per CPU of ``auto``'s list.

    The bound lists are ``auto``'s list for one engine, cut to the thread count.
    """
    from loraplex.engine.core.cpu_bind import (
        CpuTopology,
        auto_cpu_lists,
        format_cpu_list,
    )

    lists = auto_cpu_lists(1, allowed, CpuTopology.read())
    auto = list(lists[0]) if lists else allowed
    counts = sorted({1, len(auto)})
    out = []
    for n in counts:
        out.append({"name": f"nobind x{n}", "threads": n, "bind": "nobind"})
        out.append({"name": f"bind {format_cpu_list(auto[:n])} x{n}", "threads": n,
                    "bind": format_cpu_list(auto[:n])})  # fmt: skip
    return out


def run_child(spec: dict, timeout: float) -> dict:
    """``python -m bench.cpu_threads --child SPEC`` in a fresh process; its figures.

    Raises:
        RuntimeError: the child failed (with the tail of its stderr).
    """
    run = subprocess.run(
        [sys.executable, "-m", "bench.cpu_threads", "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if run.returncode != 0:
        raise RuntimeError(f"{spec['name']}: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    """Parse the flags, run the rounds, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 requests, 1 round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument(
        "--preset", choices=["smollm-135m", "tiny"], default=None,
        help="model (default: smollm-135m; tiny with --quick)",
    )  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not hasattr(os, "sched_setaffinity"):
        parser.error("binding CPUs needs Linux (os.sched_setaffinity)")
    preset = args.preset or ("tiny" if args.quick else "smollm-135m")
    rounds = 1 if args.quick else args.rounds
    requests, output = (2, 8) if args.quick else (REQUESTS, OUTPUT)
    allowed = sorted(os.sched_getaffinity(0))
    configs = configurations(allowed)
    if args.quick:  # the plumbing: one thread, bound and not (two fresh processes, not four)
        configs = [c for c in configs if c["threads"] == 1]
    results: dict[str, list[dict]] = {c["name"]: [] for c in configs}
    for r in range(rounds):
        for c in configs:
            spec = {**c, "preset": preset, "requests": requests, "output": output}
            results[c["name"]].append(run_child(spec, timeout=600))
            print(f"round {r + 1} {c['name']}: {results[c['name']][-1]['tokens_per_s']:.1f} "
                  "tok/s", file=sys.stderr, flush=True)  # fmt: skip
    print(
        f"{preset}: {requests} requests of {PROMPT} prompt tokens, {output} output tokens; "
        f"CPUs {allowed}; {rounds} interleaved rounds, a fresh process per run"
    )
    print(f"{'configuration':<16} {'median tok/s':>12}  rounds (tok/s)  CPU s per s")
    figures = {}
    for c in configs:
        runs = results[c["name"]]
        rates = [x["tokens_per_s"] for x in runs]
        busy = statistics.median(x["cpu_per_wall"] for x in runs)
        print(
            f"{c['name']:<16} {statistics.median(rates):>12.1f}  "
            f"{' '.join(f'{x:.1f}' for x in rates)}  {busy:.2f}"
        )
        figures[c["name"]] = {
            "median_tokens_per_s": statistics.median(rates),
            "tokens_per_s": rates,
            "cpu_per_wall": busy,
            "threads": runs[0]["threads"],
            "affinity": runs[0]["affinity"],
            "pinned": runs[0]["pinned"],
        }
    print(json.dumps({"preset": preset, "requests": requests, "prompt_tokens": PROMPT,
                      "output_tokens": output, "rounds": rounds, "cpus": allowed,
                      "configurations": figures}))  # fmt: skip


if __name__ == "__main__":
    main()
