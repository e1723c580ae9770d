"""Benchmark: the kernels' launch heuristics against every choice they could make (GPU only).

(a) Decode attention: for each (batch, context) the achieved bytes/s over the copy bandwidth
    at every KV split count from 1 to 64 (``paged_attention(num_splits=...)``), next to the
    split count ``kernels.triton_split_kv.num_kv_splits`` picks: the heuristic is right where its
    pick is the best (or within noise of it).
(b) LoRA shrink + expand (rank 16, 4096 -> 4096, bfloat16, 256 tokens and 64-token decode
    steps over 1 to 64 adapters): time at every shrink split-K, next to the one
    ``kernels.lora_ops.shrink_split_k`` picks, as a share of the base projection ``x @ W.T``;
    also timed as a replayed CUDA graph (what a captured decode step pays: no launch gaps).

Shapes as ``bench.kernels`` (Llama-3-8B attention, block 16). Timing: ``triton.testing.do_bench``
medians. Run: ``python -m bench.kernel_tuning``; prints a table, then one JSON line. Needs CUDA.
"""

from __future__ import annotations

import json
import sys
from functools import partial

import torch

from bench.kernels import ATTN, LORA, copy_bandwidth, paged_problem, rounded

DECODE_SHAPES = [(1, 32768), (16, 2048), (16, 4096), (16, 8192), (64, 2048), (64, 4096)]
DECODE_SHAPES += [(256, 512)]
SPLITS = [1, 2, 4, 8, 16, 32, 64]
LORA_CASES = [(256, 1), (256, 16), (256, 64), (64, 1), (64, 16), (64, 64)]
SPLIT_KS = [1, 2, 4, 8, 16, 32]


def timer():
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=10, rep=100, return_mode="median") / 1e3


def graph_time(fn, time_fn) -> float:
    """Seconds per replay of ``fn`` captured in a CUDA graph (after a warm-up call)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_fn(graph.replay)


def tune_decode(device, time_fn, copy_bps) -> list[dict]:
    from loraplex.kernels.triton_attention import TILE_N, paged_attention
    from loraplex.kernels.triton_split_kv import num_kv_splits

    cfg, dtype, rows = ATTN, torch.bfloat16, []
    for batch, context in DECODE_SHAPES:
        args = paged_problem(batch, context, 1, cfg, dtype, device)
        kv = 2 * batch * context * cfg["kv_heads"] * cfg["head_dim"] * 2
        moved = kv + 2 * args[0].numel() * 2 + args[3].numel() * 4
        kw = {"max_query_len": 1, "max_seq_len": context}
        scale = cfg["head_dim"] ** -0.5
        picked = num_kv_splits(batch * cfg["kv_heads"], 1, context, TILE_N, device)
        want = paged_attention(*args, scale, num_splits=1, **kw).float()
        by_split = {}
        for s in SPLITS:
            if s > -(-context // TILE_N):  # more splits than tiles of keys
                continue
            got = paged_attention(*args, scale, num_splits=s, **kw).float()
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            t = time_fn(partial(paged_attention, *args, scale, num_splits=s, **kw))
            by_split[s] = moved / t / copy_bps
        best = max(by_split, key=by_split.get)
        row = {"batch": batch, "context": context, "picked": picked, "best": best}
        row |= {f"split_{s}": f for s, f in by_split.items()}
        row["picked_fraction"] = by_split.get(picked)
        row["best_fraction"] = by_split[best]
        rows.append(row)
        print("decode", json.dumps(rounded([row])[0]), file=sys.stderr, flush=True)
        del args
    return rows


def tune_lora(device, time_fn) -> list[dict]:
    from loraplex.kernels.lora_ops import (
        SHRINK_BLOCK_K,
        lora_expand,
        lora_shrink,
        make_lora_batch,
        shrink_split_k,
    )

    dtype, rows = torch.bfloat16, []
    hidden, out_dim, rank = LORA["hidden"], LORA["out"], LORA["rank"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(out_dim, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    for tokens, n in LORA_CASES:
        x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
        a = (torch.randn(n, rank, hidden, generator=gen) / hidden**0.5).to(device, dtype)
        b = (torch.randn(n, out_dim, rank, generator=gen) / rank**0.5).to(device, dtype)
        scales = torch.full((n,), 2.0, device=device)
        batch = make_lora_batch([i % n for i in range(tokens)], device)
        y = torch.zeros(tokens, out_dim, device=device, dtype=dtype)
        base = time_fn(lambda x=x: x @ weight.T)
        base_graph = graph_time(lambda x=x: x @ weight.T, time_fn)
        programs = batch.num_blocks
        picked = shrink_split_k(programs, hidden, SHRINK_BLOCK_K, x)

        def run(split_k, x=x, a=a, b=b, scales=scales, batch=batch, y=y):
            return lora_expand(y, lora_shrink(x, a, batch, split_k=split_k), b, scales, batch)

        want = lora_expand(
            torch.zeros_like(y), lora_shrink(x, a, batch, split_k=1), b, scales, batch
        )
        row = {"tokens": tokens, "adapters": n, "picked": picked, "base_us": base * 1e6}
        row["base_graph_us"] = base_graph * 1e6
        for k in SPLIT_KS:
            got = lora_expand(
                torch.zeros_like(y), lora_shrink(x, a, batch, split_k=k), b, scales, batch
            )
            torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
            row[f"split_k_{k}_us"] = time_fn(partial(run, k)) * 1e6
        best = min(SPLIT_KS, key=lambda k: row[f"split_k_{k}_us"])
        row["best"] = best
        row["picked_us"] = row[f"split_k_{picked}_us"]
        row["picked_vs_base"] = row["picked_us"] / row["base_us"]
        row["picked_graph_us"] = graph_time(partial(run, picked), time_fn) * 1e6
        row["picked_graph_vs_base_graph"] = row["picked_graph_us"] / row["base_graph_us"]
        rows.append(row)
        print("lora", json.dumps(rounded([row])[0]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernel_tuning needs a CUDA GPU (the heuristics are GPU-only)")
    device = torch.device("cuda")
    time_fn = timer()
    copy_bps = copy_bandwidth(device, time_fn)
    decode = tune_decode(device, time_fn, copy_bps)
    lora = tune_lora(device, time_fn)
    print(f"device {torch.cuda.get_device_name(device)}, copy {copy_bps / 1e9:.0f} GB/s")
    print(f"{'decode':<20}{'picked':>7}{'of copy':>9}{'best':>6}{'of copy':>9}")
    for r in decode:
        label = f"batch {r['batch']} ctx {r['context']}"
        pf = r["picked_fraction"]
        print(
            f"{label:<20}{r['picked']:>7}{'-' if pf is None else format(pf, '.2f'):>9}"
            f"{r['best']:>6}{r['best_fraction']:>9.2f}"
        )
    print(f"{'lora':<20}{'picked':>7}{'us':>8}{'x base':>8}{'best':>6}{'graph x base':>14}")
    for r in lora:
        label = f"{r['tokens']} tok {r['adapters']} adapters"
        print(
            f"{label:<20}{r['picked']:>7}{r['picked_us']:>8.1f}{r['picked_vs_base']:>8.2f}"
            f"{r['best']:>6}{r['picked_graph_vs_base_graph']:>14.2f}"
        )
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(device),
                "copy_gbs": copy_bps / 1e9,
                "decode": rounded(decode),
                "lora": rounded(lora),
            }
        )
    )


if __name__ == "__main__":
    main()
