"""Benchmark: interactive latency while a batch runs, and the batch's own throughput (issue 31).

Batch lines are engine requests of the batch priority class (``EngineRequest.priority``): the
scheduler admits them only while no interactive request waits, preempts them first and leaves
them out of a step that carries an interactive prefill (docs/engine.md, *Priority classes*). On
one engine (the ``bench`` preset text model, greedy, prefix caching off so every prompt is
computed), measured in the same run:

- interactive TTFT (time from ``add_request`` to the first token, wall clock) of requests
  arriving every ``--interval`` seconds, on an idle engine; also from when each was due
  (``from due``: it includes the wait for the step in progress, which a server's caller sees);
- the same arrivals while a batch of ``--batch`` requests runs, with priority classes, and
  again with the batch sent as interactive requests (what a server without classes does);
- the batch's throughput (generated tokens per second) alone, and after the interactive
  arrivals stop (the issue's ">= 80 % of its throughput alone").

The longest step of each run is printed too: on a shared machine a step far above the others
(another process holding a core) decides a p99 of 40 requests on its own.

Run: ``python -m bench.batch_priority [--quick]``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.throughput import model_dir
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE, EngineRequest
from loraplex.engine.sampling.params import SamplingParams

PROMPT = 64


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of :data:`PROMPT` random token ids in ``[16, vocab)`` (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(16, vocab, (PROMPT,), generator=gen).tolist() for _ in range(n)]


def p99(values: list[float]) -> float:
    """The 99th percentile (nearest rank) of ``values``; raises IndexError when empty."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run(
    path, batch: list[list[int]], interactive: list[list[int]], interval: float, priority: int
) -> dict[str, float]:
    """One engine, the batch submitted at once, interactive requests every ``interval`` s."""
    engine = LLM(
        EngineConfig(
            model=str(path), num_kv_blocks=2048, max_num_seqs=16, enable_prefix_caching=False
        )
    ).engine
    warm = SamplingParams(temperature=0, max_tokens=2)
    engine.add_request(EngineRequest("warm", [20] * 40, warm))
    while engine.has_unfinished_requests():
        engine.step()
    batch_params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    inter_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(
            EngineRequest(f"b{i}", list(p), batch_params, tenant="batch", priority=priority)
        )
    start = time.perf_counter()
    added: dict[str, float] = {}
    due: dict[str, float] = {}  # when it was due to arrive (it waits for the step in progress)
    ttft: dict[str, float] = {}
    ttft_due: dict[str, float] = {}
    batch_tokens_after = 0
    interactive_done_at: float | None = None
    batch_done_at: float | None = None
    next_i = 0
    pending_inter = len(interactive)
    longest_step = 0.0  # a step far above the others is the machine, not the scheduler
    while engine.has_unfinished_requests() or next_i < len(interactive):
        now = time.perf_counter()
        while next_i < len(interactive) and now >= start + next_i * interval:
            rid = f"i{next_i}"
            engine.add_request(
                EngineRequest(
                    rid,
                    list(interactive[next_i]),
                    inter_params,
                    tenant="user",
                    priority=PRIORITY_INTERACTIVE,
                )
            )
            added[rid] = time.perf_counter()
            due[rid] = start + next_i * interval
            next_i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + next_i * interval - time.perf_counter()))
            continue
        t_step = time.perf_counter()
        outs = engine.step()
        longest_step = max(longest_step, time.perf_counter() - t_step)
        for out in outs:
            rid = out.request_id
            if rid.startswith("i"):
                if out.outputs[0].token_ids and rid not in ttft:
                    ttft[rid] = time.perf_counter() - added[rid]
                    ttft_due[rid] = time.perf_counter() - due[rid]
                if out.finished:
                    pending_inter -= 1
                    if pending_inter == 0:
                        interactive_done_at = time.perf_counter()
            elif interactive_done_at is not None:
                batch_tokens_after += len(out.outputs[0].token_ids)
            if (
                rid.startswith("b")
                and out.finished
                and not any(r.startswith("b") for r in _unfinished(engine))
            ):
                batch_done_at = time.perf_counter()
    end = batch_done_at or time.perf_counter()
    after = (
        batch_tokens_after / (end - interactive_done_at)
        if interactive_done_at is not None and end > interactive_done_at
        else 0.0
    )
    total = len(batch) * batch_params.max_tokens
    return {
        "ttft_p99_s": p99(list(ttft.values())) if ttft else 0.0,
        "ttft_due_p99_s": p99(list(ttft_due.values())) if ttft_due else 0.0,
        "batch_tok_s": total / (end - start) if batch else 0.0,
        "batch_tok_s_after_interactive": after,
        "preemptions": engine.scheduler.num_preemptions,
        "longest_step_s": longest_step,
    }


def _unfinished(engine) -> list[str]:
    s = engine.scheduler
    return [q.request.request_id for q in (*s.running, *s.waiting)]


def main() -> None:
    """The command line (see the module docstring): the table, then the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 48-request batch (< 60 s)")
    parser.add_argument("--batch", type=int, default=None, help="batch requests (default 1000)")
    parser.add_argument("--interval", type=float, default=0.25, help="s between interactive")
    args = parser.parse_args()
    n_batch = args.batch or (48 if args.quick else 1000)
    n_inter = 8 if args.quick else 40
    path = model_dir()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    batch, inter = prompts(n_batch, vocab, 1), prompts(n_inter, vocab, 2)
    idle = run(path, [], inter, args.interval, PRIORITY_BATCH)
    classes = run(path, batch, inter, args.interval, PRIORITY_BATCH)
    flat = run(path, batch, inter, args.interval, PRIORITY_INTERACTIVE)
    alone = run(path, batch, [], args.interval, PRIORITY_BATCH)
    print(
        f"batch {n_batch} x ({PROMPT} prompt + 32 generated) tokens; {n_inter} interactive "
        f"requests ({PROMPT} + 8) every {args.interval} s; model {path.name}"
    )
    print(
        f"{'run':<34}{'TTFT p99 ms':>12}{'from due ms':>12}{'batch tok/s':>13}{'preemptions':>13}"
    )
    for name, r in (
        ("interactive alone", idle),
        ("with batch, priority classes", classes),
        ("with batch, no classes", flat),
        ("batch alone", alone),
    ):
        print(
            f"{name:<34}{r['ttft_p99_s'] * 1e3:>12.1f}{r['ttft_due_p99_s'] * 1e3:>12.1f}"
            f"{r['batch_tok_s']:>13.1f}"
            f"{r['preemptions']:>13}"
        )
    print(
        json.dumps(
            {
                "ttft_p99_ms_idle": round(idle["ttft_p99_s"] * 1e3, 1),
                "ttft_p99_ms_with_batch": round(classes["ttft_p99_s"] * 1e3, 1),
                "ttft_p99_ms_with_batch_no_classes": round(flat["ttft_p99_s"] * 1e3, 1),
                "ttft_p99_ratio": round(classes["ttft_p99_s"] / idle["ttft_p99_s"], 2),
                "ttft_p99_ratio_no_classes": round(flat["ttft_p99_s"] / idle["ttft_p99_s"], 2),
                "ttft_due_p99_ms_idle": round(idle["ttft_due_p99_s"] * 1e3, 1),
                "ttft_due_p99_ms_with_batch": round(classes["ttft_due_p99_s"] * 1e3, 1),
                "ttft_due_p99_ratio": round(classes["ttft_due_p99_s"] / idle["ttft_due_p99_s"], 2),
                "longest_step_ms_idle": round(idle["longest_step_s"] * 1e3, 1),
                "longest_step_ms_with_batch": round(classes["longest_step_s"] * 1e3, 1),
                "batch_tok_s_alone": round(alone["batch_tok_s"], 1),
                "batch_tok_s_after_interactive": round(classes["batch_tok_s_after_interactive"], 1),
                "batch_throughput_ratio": round(
                    classes["batch_tok_s_after_interactive"] / alone["batch_tok_s"], 2
                ),
                "batch_requests": n_batch,
                "interactive_requests": n_inter,
            }
        )
    )


if __name__ == "__main__":
    main()
