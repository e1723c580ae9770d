"""Benchmark: the Triton kernels (issue 6) against their baselines, in one run.

(a) Decode attention over the paged cache at batch 1, 16, 64, 256 and contexts 512 to 32k
    (Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128, block 16, bfloat16),
    as achieved bytes/s (K/V read once, plus queries and outputs) over the device's copy
    bandwidth, measured in the same run (``dst.copy_(src)`` of a large tensor, read + write).
(b) Prefill attention (fresh prompts, causal) in TFLOP/s against
    ``torch.nn.functional.scaled_dot_product_attention`` on the same K/V gathered contiguous.
(c) LoRA shrink + expand (rank 16, 4096 -> 4096, 256 tokens spread evenly over 1 to 64
    distinct adapters) against a per-adapter torch loop and against the dense base
    projection ``x @ W.T`` (ratio).

On a GPU the Triton kernels are timed with ``triton.testing.do_bench`` (median). On CPU the
kernels would only run under the Triton interpreter, which says nothing about speed: the CPU
run times the same comparisons on small shapes with the plain-torch references in the kernel
columns' place (``reference_*``), and the kernel figures are null: they need a GPU.
``--interpret`` runs the kernel columns on CPU under the interpreter on tiny shapes, to smoke
the GPU code path (its numbers mean nothing).

Run: ``python -m bench.kernels [--quick] [--interpret]``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

ATTN = {"heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16}
CPU_ATTN = {"heads": 8, "kv_heads": 2, "head_dim": 128, "block_size": 16}
LORA = {"tokens": 256, "hidden": 4096, "out": 4096, "rank": 16}
CPU_LORA = {"tokens": 64, "hidden": 1024, "out": 1024, "rank": 16}


def plan(device: torch.device, quick: bool, interpret: bool) -> dict:
    """Shapes per mode: the issue's on a GPU, small ones on CPU, tiny under the interpreter."""
    if device.type == "cuda":
        return {
            "attn": ATTN,
            "lora": LORA,
            "batches": [1, 64] if quick else [1, 16, 64, 256],
            "contexts": [512, 4096] if quick else [512, 1024, 2048, 4096, 8192, 16384, 32768],
            "prefill": [(4, 1024)] if quick else [(1, 8192), (4, 2048), (16, 1024)],
            "adapters": [1, 16] if quick else [1, 2, 4, 8, 16, 32, 64],
            "dtype": torch.bfloat16,
        }
    if interpret:
        return {
            "attn": {"heads": 4, "kv_heads": 2, "head_dim": 64, "block_size": 16},
            "lora": {"tokens": 16, "hidden": 64, "out": 64, "rank": 16},
            "batches": [2],
            "contexts": [64],
            "prefill": [(1, 32)],
            "adapters": [1, 4],
            "dtype": torch.float32,
        }
    return {
        "attn": CPU_ATTN,
        "lora": CPU_LORA,
        "batches": [1, 16],
        "contexts": [512] if quick else [512, 2048],
        "prefill": [(2, 256)] if quick else [(1, 512), (4, 256)],
        "adapters": [1, 16] if quick else [1, 4, 16, 64],
        "dtype": torch.float32,
    }


def timer(device: torch.device, quick: bool):
    """``fn -> seconds``: do_bench's median on a GPU, the best of repeated calls on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: (
            do_bench(fn, warmup=10, rep=50 if quick else 200, return_mode="median") / 1e3
        )

    def best(fn):  # the minimum resists the spikes of a shared machine
        fn()
        times: list[float] = []
        while len(times) < 3 or (sum(times) < budget and len(times) < 50):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    budget = 0.1 if quick else 0.3  # seconds of calls per figure
    return best


def progress(kind: str, row: dict) -> None:
    """One measured row on stderr as it lands, so a run cut short still tells what it got."""
    print(kind, json.dumps(rounded([row])[0]), file=sys.stderr, flush=True)


def copy_bandwidth(device: torch.device, time_fn) -> float:
    """Bytes/s of ``dst.copy_(src)`` (read + write) on a 1 GiB (GPU) or 256 MiB (CPU) tensor."""
    nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_fn(lambda: dst.copy_(src))


def paged_problem(batch, context, new, cfg, dtype, device):
    """Caches behind shuffled block tables, as the attention kernels' positional arguments.

    ``batch`` sequences of ``context`` positions each, whose last ``new`` are this step's queries.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    bs = cfg["block_size"]
    per_seq = -(-context // bs)
    shape = (batch * per_seq, bs, cfg["kv_heads"], cfg["head_dim"])
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
    tables = tables.to(device=device, dtype=torch.int32)
    query = torch.randn(batch * new, cfg["heads"], cfg["head_dim"], dtype=dtype, device=device)
    qsl = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return query, k_cache, v_cache, tables, seq_lens, qsl


def bench_decode(p, device, time_fn, copy_bps, kernels, budget) -> list[dict]:
    from loraplex.kernels.paged_attention_ref import paged_attention_ref

    cfg, dtype, rows = p["attn"], p["dtype"], []
    elem = torch.tensor([], dtype=dtype).element_size()
    for batch in p["batches"]:
        for context in p["contexts"]:
            row = {"batch": batch, "context": context, "triton_gbs": None}
            row |= {"triton_fraction_of_copy": None, "reference_gbs": None}
            row["reference_fraction_of_copy"] = None
            kv = 2 * batch * context * cfg["kv_heads"] * cfg["head_dim"] * elem
            if kv > budget:
                rows.append(row | {"skipped": "memory"})
                continue
            args = paged_problem(batch, context, 1, cfg, dtype, device)
            moved = kv + 2 * args[0].numel() * elem + args[3].numel() * 4
            kw = {"max_query_len": 1, "max_seq_len": context}
            scale = cfg["head_dim"] ** -0.5
            if kernels:
                from loraplex.kernels.triton_attention import paged_attention

                if not rows:  # the first shape doubles as a correctness check
                    torch.testing.assert_close(
                        paged_attention(*args, scale, **kw).float(),
                        paged_attention_ref(*args, scale, **kw).float(),
                        atol=3e-2,
                        rtol=3e-2,
                    )
                t = time_fn(partial(paged_attention, *args, scale, **kw))
                row["triton_gbs"] = moved / t / 1e9
                row["triton_fraction_of_copy"] = moved / t / copy_bps
            if device.type == "cpu":
                t = time_fn(partial(paged_attention_ref, *args, scale, **kw))
                row["reference_gbs"] = moved / t / 1e9
                row["reference_fraction_of_copy"] = moved / t / copy_bps
            rows.append(row)
            progress("decode", row)
            del args
    return rows


def bench_prefill(p, device, time_fn, kernels) -> list[dict]:
    from loraplex.kernels.paged_attention_ref import paged_attention_ref

    cfg, dtype, rows = p["attn"], p["dtype"], []
    heads, kv_heads, dim = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    for seqs, length in p["prefill"]:
        args = paged_problem(seqs, length, length, cfg, dtype, device)
        query, k_cache, v_cache, tables = args[:4]
        flops = 4 * seqs * heads * dim * length * (length + 1) / 2  # QK^T and PV, causal
        # The same K/V gathered contiguous, once, outside the timing: [seqs, Hkv, L, D].
        pos = torch.arange(length, device=device)
        slots = (
            tables.long()[:, pos // cfg["block_size"]] * cfg["block_size"] + pos % cfg["block_size"]
        )
        kc = k_cache.view(-1, kv_heads, dim)[slots].transpose(1, 2).contiguous()
        vc = v_cache.view(-1, kv_heads, dim)[slots].transpose(1, 2).contiguous()
        qc = query.view(seqs, length, heads, dim).transpose(1, 2).contiguous()
        sdpa = partial(F.scaled_dot_product_attention, qc, kc, vc, is_causal=True, enable_gqa=True)
        kw = {"max_query_len": length, "max_seq_len": length}
        row = {"seqs": seqs, "length": length, "triton_tflops": None, "triton_vs_sdpa": None}
        row["sdpa_tflops"] = flops / time_fn(sdpa) / 1e12
        row["reference_tflops"] = None
        if kernels:
            from loraplex.kernels.triton_attention import paged_attention

            out = paged_attention(*args, dim**-0.5, **kw)
            ref = sdpa().transpose(1, 2).reshape(out.shape)
            torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
            t = time_fn(partial(paged_attention, *args, dim**-0.5, **kw))
            row["triton_tflops"] = flops / t / 1e12
            row["triton_vs_sdpa"] = row["triton_tflops"] / row["sdpa_tflops"]
        if device.type == "cpu":
            t = time_fn(partial(paged_attention_ref, *args, dim**-0.5, **kw))
            row["reference_tflops"] = flops / t / 1e12
        rows.append(row)
        progress("prefill", row)
    return rows


def torch_loop(y, x, a, b, scales, groups):
    """The baseline: one shrink and one expand per adapter, as a torch user would write it."""
    for s, idx in groups:
        y.index_add_(0, idx, ((x[idx] @ a[s].T) @ b[s].T * scales[s]).to(y.dtype))
    return y


def triton_lora(y, x, a, b, scales, batch):
    """One Triton shrink and one expand launch for every adapter of the step."""
    from loraplex.kernels.lora_ops import lora_expand, lora_shrink

    return lora_expand(y, lora_shrink(x, a, batch), b, scales, batch)


def reference_lora(y, x, a, b, scales, slots):
    """The float32 references of the shrink and the expand (``kernels.lora_ref``)."""
    from loraplex.kernels.lora_ref import lora_expand_ref, lora_shrink_ref

    token_slots = torch.tensor(slots, device=x.device)
    return lora_expand_ref(y, lora_shrink_ref(x, a, token_slots), b, scales, token_slots)


def bench_lora(p, device, time_fn, kernels) -> list[dict]:
    cfg, dtype, rows = p["lora"], p["dtype"], []
    tokens, hidden, out_dim, rank = cfg["tokens"], cfg["hidden"], cfg["out"], cfg["rank"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(out_dim, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    base_t = time_fn(lambda: x @ weight.T)
    for n in p["adapters"]:
        a = (torch.randn(n, rank, hidden, generator=gen) / hidden**0.5).to(device, dtype)
        b = (torch.randn(n, out_dim, rank, generator=gen) / rank**0.5).to(device, dtype)
        scales = torch.full((n,), 2.0, device=device)
        slots = [i % n for i in range(tokens)]  # distinct adapters, evenly used
        groups = [
            (s, torch.tensor(slots, device=device).eq(s).nonzero().squeeze(1)) for s in range(n)
        ]
        y = torch.zeros(tokens, out_dim, device=device, dtype=dtype)
        row = {"adapters": n, "tokens": tokens, "triton_us": None, "triton_vs_base": None}
        row["triton_speedup_vs_loop"] = None
        row["torch_loop_us"] = time_fn(partial(torch_loop, y, x, a, b, scales, groups)) * 1e6
        row["base_us"] = base_t * 1e6
        row["torch_loop_vs_base"] = row["torch_loop_us"] / row["base_us"]
        row["reference_us"] = None
        if device.type == "cpu":  # the float32 references: kernels.lora_ref
            row["reference_us"] = time_fn(partial(reference_lora, y, x, a, b, scales, slots)) * 1e6
        if kernels:
            from loraplex.kernels.lora_ops import make_lora_batch

            batch = make_lora_batch(slots, device)  # once per step, not per projection
            if not rows:  # the first shape doubles as a correctness check
                want = torch_loop(torch.zeros_like(y), x, a, b, scales, groups)
                got = triton_lora(torch.zeros_like(y), x, a, b, scales, batch)
                torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
            row["triton_us"] = time_fn(partial(triton_lora, y, x, a, b, scales, batch)) * 1e6
            row["triton_vs_base"] = row["triton_us"] / row["base_us"]
            row["triton_speedup_vs_loop"] = row["torch_loop_us"] / row["triton_us"]
        rows.append(row)
        progress("lora", row)
    return rows


def rounded(rows: list[dict]) -> list[dict]:
    """Rows with floats to 4 significant digits, for the JSON line."""
    return [
        {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in r.items()} for r in rows
    ]


def fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes (< 60 s on 2 cores)")
    parser.add_argument(
        "--interpret", action="store_true", help="CPU: run the kernels under the interpreter"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    interpret = args.interpret and device.type == "cpu"
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported
    kernels = device.type == "cuda" or interpret
    p = plan(device, args.quick, interpret)
    time_fn = timer(device, args.quick)
    copy_bps = copy_bandwidth(device, time_fn)
    budget = torch.cuda.mem_get_info()[0] // 3 if device.type == "cuda" else 512 << 20
    decode = bench_decode(p, device, time_fn, copy_bps, kernels, budget)
    prefill = bench_prefill(p, device, time_fn, kernels)
    lora = bench_lora(p, device, time_fn, kernels)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    note = "" if device.type == "cuda" else " (kernel figures need a GPU: null here)"
    print(f"device {name or 'cpu'}, {p['dtype']}, copy bandwidth {copy_bps / 1e9:.1f} GB/s{note}")
    print(f"{'decode':<24}{'triton GB/s':>13}{'of copy':>9}{'ref GB/s':>10}{'of copy':>9}")
    for r in decode:
        label = f"batch {r['batch']} ctx {r['context']}"
        skipped = f"  skipped ({r['skipped']})" if "skipped" in r else ""
        print(
            f"{label:<24}{fmt(r['triton_gbs'], '.1f'):>13}{fmt(r['triton_fraction_of_copy']):>9}"
            f"{fmt(r['reference_gbs'], '.2f'):>10}{fmt(r['reference_fraction_of_copy'], '.3f'):>9}"
            f"{skipped}"
        )
    print(f"{'prefill':<24}{'triton TF/s':>13}{'sdpa TF/s':>11}{'x sdpa':>8}{'ref TF/s':>10}")
    for r in prefill:
        label = f"{r['seqs']} x {r['length']} tokens"
        print(
            f"{label:<24}{fmt(r['triton_tflops'], '.3f'):>13}{fmt(r['sdpa_tflops'], '.3f'):>11}"
            f"{fmt(r['triton_vs_sdpa']):>8}{fmt(r['reference_tflops'], '.3f'):>10}"
        )
    print(
        f"{'lora shrink+expand':<24}{'triton us':>11}{'loop us':>10}{'ref us':>10}{'base us':>10}"
        f"{'loop/base':>11}{'triton/base':>13}"
    )
    for r in lora:
        label = f"{r['adapters']} adapters, {r['tokens']} tok"
        print(
            f"{label:<24}{fmt(r['triton_us'], '.1f'):>11}{r['torch_loop_us']:>10.1f}"
            f"{fmt(r['reference_us'], '.1f'):>10}"
            f"{r['base_us']:>10.1f}{r['torch_loop_vs_base']:>11.2f}{fmt(r['triton_vs_base']):>13}"
        )
    print(
        json.dumps(
            {
                "device": name or "cpu",
                "dtype": str(p["dtype"]).removeprefix("torch."),
                "kernels_measured": device.type == "cuda",
                "interpreted": interpret,
                "note": None if device.type == "cuda" else "Triton figures need a GPU",
                "copy_gbs": round(copy_bps / 1e9, 2),
                "decode": rounded(decode),
                "prefill": rounded(prefill),
                "lora": rounded(lora),
            }
        )
    )


if __name__ == "__main__":
    main()
