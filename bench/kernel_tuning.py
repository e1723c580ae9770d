"""Benchmark: the kernels' launch heuristics against every choice they could make (GPU only).

(a) Decode attention: for each (batch, context) the achieved bytes/s over the copy bandwidth
    at every KV split count from 1 to 64 (``paged_attention(num_splits=...)``), next to the
    split count ``kernels.triton_split_kv.num_kv_splits`` picks: the heuristic is right where its
    pick is the best (or within noise of it).
(b) LoRA shrink + expand (rank 16, 4096 -> 4096, bfloat16, 256 tokens and 64-token decode
    steps over 1 to 64 adapters): time at every shrink split-K, next to the one
    ``kernels.lora_ops.shrink_split_k`` picks, as a share of the base projection ``x @ W.T``;
    also timed as a replayed CUDA graph (what a captured decode step pays: no launch gaps).
(c) Launch options: prefill tiles (``PREFILL_BLOCK_M``, ``TILE_N``), warps and stages against
    ``scaled_dot_product_attention``; decode warps and stages, over the copy bandwidth.

Shapes as ``bench.kernels`` (Llama-3-8B attention, block 16). Timing: ``triton.testing.do_bench``
medians. Run: ``python -m bench.kernel_tuning [--quick]``; prints a table, then one JSON line.
The figures need CUDA. ``--quick``: on a GPU three decode shapes, two LoRA cases and four launch
options; on CPU the same code path on tiny shapes under the Triton interpreter, timed by the wall
clock, graphs replaced by eager calls (a smoke of the sweeps: its numbers mean nothing). Without
``--quick`` on CPU it exits with an error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from functools import partial

import torch

from bench.kernels import ATTN, LORA, copy_bandwidth, paged_problem, rounded

DECODE_SHAPES = [(1, 32768), (16, 2048), (16, 4096), (16, 8192), (64, 2048), (64, 4096)]
DECODE_SHAPES += [(256, 512)]
SPLITS = [1, 2, 4, 8, 16, 32, 64]
LORA_CASES = [(256, 1), (256, 16), (256, 64), (64, 1), (64, 16), (64, 64)]
SPLIT_KS = [1, 2, 4, 8, 16, 32]
PREFILL_SHAPE = (4, 2048)  # sequences x tokens, for the launch options
LAUNCH_DECODE_SHAPES = [(16, 4096), (64, 2048)]
# Prefill (query rows, key tile, warps, stages), the defaults first.
LAUNCH_OPTIONS = list(itertools.product([64, 128], [64, 128], [4, 8], [3, 2]))


def timer():
    """``fn -> seconds``: ``triton.testing.do_bench``'s median (CUDA events, warmed up)."""
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
    """Decode attention at every split count, one row per ``DECODE_SHAPES`` entry.

    Each row: the fraction of ``copy_bps`` (bytes/s) at each split count (each checked against
    the unsplit output), the heuristic's pick, the best, and the pick replayed from a CUDA
    graph. bfloat16, ``ATTN``'s heads.
    """
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
        # Replayed from a CUDA graph, as the engine's captured decode steps run it: no launch
        # gaps (eager timings of these 30-130 us launches move with Python's launch cost).
        t = graph_time(partial(paged_attention, *args, scale, num_splits=picked, **kw), time_fn)
        row["picked_graph_fraction"] = moved / t / copy_bps
        rows.append(row)
        print("decode", json.dumps(rounded([row])[0]), file=sys.stderr, flush=True)
        del args
    return rows


def tune_launch(device, time_fn, copy_bps) -> list[dict]:
    """Prefill tiles and warps, decode warps and stages, against the defaults (module knobs)."""
    import torch.nn.functional as F

    from loraplex.kernels import triton_attention as ta

    cfg, dtype, rows = ATTN, torch.bfloat16, []
    heads, kv_heads, dim = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    saved = (ta.TILE_N, ta.PREFILL_BLOCK_M, dict(ta.DECODE_LAUNCH), dict(ta.PREFILL_LAUNCH))
    seqs, length = PREFILL_SHAPE
    args = paged_problem(seqs, length, length, cfg, dtype, device)
    flops = 4 * seqs * heads * dim * length * (length + 1) / 2
    kw = {"max_query_len": length, "max_seq_len": length}
    qc = args[0].view(seqs, length, heads, dim).transpose(1, 2).contiguous()
    pos = torch.arange(length, device=device)
    slots = (
        args[3].long()[:, pos // cfg["block_size"]] * cfg["block_size"] + pos % cfg["block_size"]
    )
    kc = args[1].view(-1, kv_heads, dim)[slots].transpose(1, 2).contiguous()
    vc = args[2].view(-1, kv_heads, dim)[slots].transpose(1, 2).contiguous()
    sdpa = partial(F.scaled_dot_product_attention, qc, kc, vc, is_causal=True, enable_gqa=True)
    sdpa_tflops = flops / time_fn(sdpa) / 1e12
    want = sdpa().transpose(1, 2).reshape(args[0].shape).float()
    for block_m, tile_n, warps, stages in LAUNCH_OPTIONS:
        ta.TILE_N, ta.PREFILL_BLOCK_M = tile_n, block_m
        ta.PREFILL_LAUNCH.clear()
        ta.PREFILL_LAUNCH.update(num_warps=warps, num_stages=stages)
        row = {"kind": "prefill", "block_m": block_m, "tile_n": tile_n, "num_warps": warps}
        row |= {"num_stages": stages, "sdpa_tflops": sdpa_tflops}
        try:
            got = ta.paged_attention(*args, dim**-0.5, **kw).float()
            torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
            t = time_fn(partial(ta.paged_attention, *args, dim**-0.5, **kw))
            row["tflops"] = flops / t / 1e12
            row["vs_sdpa"] = row["tflops"] / sdpa_tflops
        except Exception as exc:  # noqa: BLE001 (out of shared memory: a row that says so)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(row)
        print("launch", json.dumps(rounded([row])[0]), file=sys.stderr, flush=True)
    ta.TILE_N, ta.PREFILL_BLOCK_M = saved[0], saved[1]
    ta.PREFILL_LAUNCH.clear()
    ta.PREFILL_LAUNCH.update(saved[3])
    del args
    for batch, context in LAUNCH_DECODE_SHAPES:
        args = paged_problem(batch, context, 1, cfg, dtype, device)
        moved = 2 * batch * context * kv_heads * dim * 2
        kw = {"max_query_len": 1, "max_seq_len": context}
        for warps, stages in itertools.product([2, 4, 8], [2, 3, 4]):
            ta.DECODE_LAUNCH.clear()
            ta.DECODE_LAUNCH.update(num_warps=warps, num_stages=stages)
            row = {"kind": "decode", "batch": batch, "context": context, "num_warps": warps}
            row["num_stages"] = stages
            try:
                t = time_fn(partial(ta.paged_attention, *args, dim**-0.5, **kw))
                row["fraction_of_copy"] = moved / t / copy_bps
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            rows.append(row)
            print("launch", json.dumps(rounded([row])[0]), file=sys.stderr, flush=True)
        del args
    ta.DECODE_LAUNCH.clear()
    ta.DECODE_LAUNCH.update(saved[2])
    return rows


def tune_lora(device, time_fn) -> list[dict]:
    """LoRA shrink + expand at every split-K, one row per ``LORA_CASES`` (tokens, adapters).

    Each row: microseconds at each ``SPLIT_KS`` value (each checked against split-K 1), the
    pick, the base projection's time, and the pick against the base both eager and replayed
    from CUDA graphs. bfloat16.
    """
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


def wall_time(fn) -> float:
    """Seconds of one call by the wall clock (the CPU smoke's timer)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def quick_plan(cuda: bool) -> None:
    """``--quick``: fewer shapes on a GPU; tiny ones and eager 'graphs' on CPU (module knobs)."""
    global DECODE_SHAPES, SPLITS, LORA_CASES, SPLIT_KS, PREFILL_SHAPE, LAUNCH_DECODE_SHAPES
    global LAUNCH_OPTIONS, graph_time
    if cuda:
        DECODE_SHAPES, LORA_CASES = DECODE_SHAPES[:3], LORA_CASES[:2]
        LAUNCH_OPTIONS = LAUNCH_OPTIONS[:4]
        return
    ATTN.update(heads=4, kv_heads=2, head_dim=32, block_size=16)
    LORA.update(tokens=16, hidden=64, out=64, rank=16)
    DECODE_SHAPES, SPLITS, LORA_CASES, SPLIT_KS = [(2, 192)], [1, 2, 4], [(16, 2)], [1, 2]
    PREFILL_SHAPE, LAUNCH_DECODE_SHAPES = (1, 32), [(2, 64)]
    LAUNCH_OPTIONS = LAUNCH_OPTIONS[:2]
    graph_time = lambda fn, time_fn: time_fn(fn)  # noqa: E731 (no CUDA graphs on CPU)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes; CPU: a smoke")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        raise SystemExit("bench.kernel_tuning needs a CUDA GPU (the heuristics are GPU-only)")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported
    if args.quick:
        quick_plan(cuda)
    device = torch.device("cuda" if cuda else "cpu")
    time_fn = timer() if cuda else wall_time
    copy_bps = copy_bandwidth(device, time_fn)
    decode = tune_decode(device, time_fn, copy_bps)
    lora = tune_lora(device, time_fn)
    launch = tune_launch(device, time_fn, copy_bps)
    name = torch.cuda.get_device_name(device) if cuda else "cpu (interpreter smoke)"
    print(f"device {name}, copy {copy_bps / 1e9:.0f} GB/s")
    print(f"{'decode':<20}{'picked':>7}{'of copy':>9}{'best':>6}{'of copy':>9}{'graph':>7}")
    for r in decode:
        label = f"batch {r['batch']} ctx {r['context']}"
        pf = r["picked_fraction"]
        print(
            f"{label:<20}{r['picked']:>7}{'-' if pf is None else format(pf, '.2f'):>9}"
            f"{r['best']:>6}{r['best_fraction']:>9.2f}{r['picked_graph_fraction']:>7.2f}"
        )
    print(f"{'lora':<20}{'picked':>7}{'us':>8}{'x base':>8}{'best':>6}{'graph x base':>14}")
    for r in lora:
        label = f"{r['tokens']} tok {r['adapters']} adapters"
        print(
            f"{label:<20}{r['picked']:>7}{r['picked_us']:>8.1f}{r['picked_vs_base']:>8.2f}"
            f"{r['best']:>6}{r['picked_graph_vs_base_graph']:>14.2f}"
        )
    ok = [r for r in launch if "error" not in r]
    for kind, key in (("prefill", "vs_sdpa"), ("decode", "fraction_of_copy")):
        best = sorted((r for r in ok if r["kind"] == kind), key=lambda r: -r[key])[:3]
        for r in best:
            print(kind, "launch", {k: v for k, v in r.items() if k != "kind"})
    print(
        json.dumps(
            {
                "device": name,
                "copy_gbs": copy_bps / 1e9,
                "decode": rounded(decode),
                "lora": rounded(lora),
                "launch": rounded(launch),
            }
        )
    )


if __name__ == "__main__":
    main()
