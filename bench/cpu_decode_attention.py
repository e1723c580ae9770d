"""Benchmark: CPU decode attention over the paged cache, gathered (current) against in place.

The torch backend's decode (``kernels.paged_attention_ref``) copies every sequence's whole
context out of the paged cache (``index_select`` of whole blocks) into a padded
``[B, Hkv, L, D]`` batch in every layer, then runs ``scaled_dot_product_attention``. The
candidates here read the cache in place (issue 30, item 1; docs/benchmarks.md has the figures
and the verdict: none is wired into the engine):

- ``flex``: ``torch.nn.attention.flex_attention`` compiled (inductor's CPU FlexAttention
  template). The cache is viewed, without a copy, as one long key sequence
  ``[1, Hkv, num_blocks * block_size, D]`` broadcast over the batch, and each sequence's block
  table *is* its row of a block-sparse ``BlockMask`` with a KV block size of one page
  (``BlockMask.from_kv_blocks``): every block but the last is "full" (no mask), the last is
  "partial" and a ``mask_mod`` keeps its first ``seq_len - (n - 1) * block_size`` positions.
  The kernel loops over the listed blocks only. One query row per sequence, grouped-query
  heads through ``enable_gqa``. The mask is built once per step (shared by every layer): its
  cost is timed apart and amortised over ``LAYERS`` layers.
- ``flex_grouped``: the engine's ``cpu_decode_attention="flex"`` path
  (``kernels.paged_attention_flex``): the same, but each KV head's query heads are the query
  rows (``[B, Hkv, G, D]``), so a K/V block is read once per KV head into a ``G x block`` tile;
  the batch is padded to a bucket.
- ``loops``: ``torch.compile`` of the decode written as indexed reductions (``cache[table]``
  inside ``(q * k).sum(-1)`` and ``(p * v).sum(-2)``): inductor's C++ codegen fuses the
  indexing into its loops (indirect loads) rather than materialising the gather.

The flex candidates compile with ``dynamic=False`` (one compilation per batch (bucket) and
cache size: ``dynamic=True`` hit inductor C++ compile errors in the CPU flex template, depending on
which dimensions became symbolic first); ``loops`` with ``dynamic=True``. Each candidate is
timed against the reference in the same process, interleaved (ref, a, b, ... per repetition),
median of ``--reps``, at 1 and 2 threads, over the SmolLM2-135M attention shape (9/3 heads,
head_dim 64) and a Llama-3-8B-like one (32/8, head_dim 128), block 16, float32, batch 1/8/32,
contexts 128-2048. The cache is a pool like an engine's (at least ``POOL_BLOCKS`` blocks, the
batch's blocks scattered in it, each length jittered below the context so last blocks are
partial). First-call seconds (compilation) and the max abs error against the reference are
reported per case.

Run: ``python -m bench.cpu_decode_attention [--quick] [--candidates flex,flex_grouped,loops]
[--threads 1,2] [--shapes smollm2-135m,llama-8b] [--batches 1,8,32] [--contexts ...]``.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from loraplex.kernels.paged_attention_flex import PagedDecodeMask, paged_decode_flex
from loraplex.kernels.paged_attention_ref import paged_attention_ref

SHAPES = {
    "smollm2-135m": {"heads": 9, "kv_heads": 3, "head_dim": 64},
    "llama-8b": {"heads": 32, "kv_heads": 8, "head_dim": 128},
}
BLOCK = 16
POOL_BLOCKS = 4096
LAYERS = 30  # the per-step mask is shared by every layer (SmolLM2-135M has 30)


def make_case(shape: dict, batch: int, context: int, seed: int = 0) -> dict:
    """A decode step: shuffled block tables over a cache with spare blocks, ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    per_seq = -(-context // BLOCK)
    # A pool like an engine's: larger than the batch needs, the batch's blocks scattered in it.
    num_blocks = max(2 * batch * per_seq, POOL_BLOCKS)
    key_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    value_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: batch * per_seq].view(batch, per_seq)
    seq_lens = context - torch.randint(0, BLOCK, (batch,), generator=g)
    return {
        "query": torch.randn(batch, heads, dim, generator=g),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": tables.to(torch.int32),
        "seq_lens": seq_lens.to(torch.int32),
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32),
        "scale": dim**-0.5,
    }


def reference(case: dict) -> torch.Tensor:
    """The current torch backend's decode (block gather + padded SDPA)."""
    return paged_attention_ref(
        case["query"],
        case["key_cache"],
        case["value_cache"],
        case["block_tables"],
        case["seq_lens"],
        case["query_start_loc"],
        case["scale"],
        max_query_len=1,
        max_seq_len=int(case["seq_lens"].max()),
    )


# ---------------------------------------------------------------- flex attention candidates
def _flex(*args, **kwargs):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(*args, **kwargs)


_COMPILED: dict = {}


def _compiled(fn):
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def flex_step(case: dict, q_rows: int = 1):
    """The per-step part: the block tables as a ``BlockMask`` (``q_rows`` query rows each)."""
    from torch.nn.attention.flex_attention import BlockMask

    tables, seq_lens = case["block_tables"], case["seq_lens"]
    num_blocks = case["key_cache"].shape[0]
    batch = seq_lens.shape[0]
    used = (seq_lens + BLOCK - 1) // BLOCK  # [B] blocks per sequence
    width = int(used.max())
    last = tables.gather(1, (used - 1).long().unsqueeze(1)).squeeze(1)
    tail = seq_lens - (used - 1) * BLOCK  # valid positions in the last block
    # The mask must cover the whole key length, so index rows are as wide as the pool; only
    # each row's first entries are read, so they are left uninitialised.
    full_idx = torch.empty(batch, 1, 1, num_blocks, dtype=torch.int32)
    full_idx[:, 0, 0, :width] = tables[:, :width]
    kv_idx = torch.empty(batch, 1, 1, num_blocks, dtype=torch.int32)
    kv_idx[:, 0, 0, 0] = last

    def keep_tail(b, h, q_idx, kv):
        return (kv % BLOCK) < tail[b]

    return BlockMask.from_kv_blocks(
        torch.ones(batch, 1, 1, dtype=torch.int32),
        kv_idx,
        (used - 1).view(batch, 1, 1).to(torch.int32),
        full_idx,
        BLOCK_SIZE=(q_rows, BLOCK),
        mask_mod=keep_tail,
        seq_lengths=(q_rows, num_blocks * BLOCK),
        compute_q_blocks=False,
    )


def _cache_as_sequence(case: dict, batch: int):
    kc, vc = case["key_cache"], case["value_cache"]
    num_blocks, block, kv_heads, dim = kc.shape
    flat = num_blocks * block
    keys = kc.view(flat, kv_heads, dim).permute(1, 0, 2).unsqueeze(0).expand(batch, -1, -1, -1)
    values = vc.view(flat, kv_heads, dim).permute(1, 0, 2).unsqueeze(0).expand(batch, -1, -1, -1)
    return keys, values


def flex_layer(case: dict) -> torch.Tensor:
    """One layer: one query row per sequence, GQA in the kernel."""
    q = case["query"]
    keys, values = _cache_as_sequence(case, q.shape[0])
    out = _compiled(_flex)(
        q.unsqueeze(2), keys, values, block_mask=case["flex_mask"], scale=case["scale"],
        enable_gqa=True,
    )  # fmt: skip
    return out.squeeze(2)


def flex_grouped_layer(case: dict) -> torch.Tensor:
    """One layer: a KV head's query heads as its query rows (the engine's ``flex`` path)."""
    return paged_decode_flex(
        case["query"], case["key_cache"], case["value_cache"], case["flex_grouped_mask"],
        case["scale"],
    )  # fmt: skip


def flex_grouped_step(case: dict) -> PagedDecodeMask:
    """The engine's per-step mask (``kernels.paged_attention_flex``)."""
    heads, kv_heads = case["query"].shape[1], case["key_cache"].shape[2]
    return PagedDecodeMask(
        case["block_tables"], case["seq_lens"], case["key_cache"].shape[0], BLOCK,
        heads // kv_heads,
    )  # fmt: skip


# ---------------------------------------------------------------- compiled loops candidate
def _loops_eager(q, kc, vc, tables, seq_lens, scale: float):
    batch, heads, dim = q.shape
    _, block, kv_heads, _ = kc.shape
    group = heads // kv_heads
    width = tables.shape[1] * block
    t = tables.long()
    keys = kc[t].view(batch, width, kv_heads, 1, dim)  # indexing, fused by inductor
    values = vc[t].view(batch, width, kv_heads, 1, dim)
    qg = q.view(batch, 1, kv_heads, group, dim)
    scores = (qg * keys).sum(-1) * scale  # [B, L, Hkv, G]
    pos = torch.arange(width).view(1, width, 1, 1)
    scores = scores.masked_fill(pos >= seq_lens.view(batch, 1, 1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=1)
    probs = torch.where(pos < seq_lens.view(batch, 1, 1, 1), probs, 0.0)
    out = (probs.unsqueeze(-1) * values).sum(1)  # [B, Hkv, G, D]
    return out.reshape(batch, heads, dim)


_LOOPS = None


def loops_decode(case: dict) -> torch.Tensor:
    """Decode as indexed reductions compiled by inductor (dynamic batch and width)."""
    global _LOOPS
    if _LOOPS is None:
        _LOOPS = torch.compile(_loops_eager, dynamic=True)
    return _LOOPS(
        case["query"],
        case["key_cache"],
        case["value_cache"],
        case["block_tables"],
        case["seq_lens"],
        case["scale"],
    )


CANDIDATES = {"flex": flex_layer, "flex_grouped": flex_grouped_layer, "loops": loops_decode}


def ab(fns: list, case: dict, reps: int) -> list[float]:
    """Median ms of each function, calls interleaved."""
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn(case)
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def engine_ab(rounds: int, requests: int, tokens: int) -> dict:
    """End to end: one engine, its decode switched between ``gather`` and ``flex`` per round.

    The engine serves ``--preset smollm-135m``'s model and workload (prefix cache off); rounds
    alternate the order (ABBA); round -1 (4 tokens each) warms both paths up, uncounted.
    Returns medians of wall seconds and of the seconds spent in decode-only attention calls
    (K/V write included) per mode; every round checks both modes' greedy tokens are equal.
    """
    from bench.throughput_smollm import model_dir, workload
    from loraplex.engine.client.llm import LLM
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.request import EngineRequest
    from loraplex.engine.sampling.params import SamplingParams

    path = model_dir()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    llm = LLM(EngineConfig(model=str(path), enable_prefix_caching=False))
    backend = llm.engine.core.runner.backend
    spent = [0.0]
    forward = backend.forward

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        if args[5].max_query_len == 1:
            spent[0] += time.perf_counter() - t0
        return out

    backend.forward = timed
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    figures: dict = {"gather": [], "flex": []}
    for r in range(-1, rounds):  # round -1: warm-up (compilations), not counted
        prompts = workload(requests, vocab, seed=r + 1)
        tokens_of = {}
        for mode in ("gather", "flex") if r % 2 == 0 else ("flex", "gather"):
            backend.cpu_decode = mode
            spent[0] = 0.0
            p = params if r >= 0 else warm
            reqs = [EngineRequest(f"{mode}{r}-{i}", list(x), p) for i, x in enumerate(prompts)]
            t0 = time.perf_counter()
            outs = llm.generate(reqs)
            wall = time.perf_counter() - t0
            tokens_of[mode] = [o.outputs[0].token_ids for o in outs]
            if r >= 0:
                figures[mode].append((wall, spent[0]))
                print(f"round {r} {mode}: wall {wall:.2f} s, decode attention {spent[0]:.2f} s")
        if tokens_of["gather"] != tokens_of["flex"]:
            raise AssertionError(f"round {r}: flex and gather generated different tokens")
        if backend.cpu_decode != "flex" and r >= 0:
            raise AssertionError("the flex path fell back to gather (see the log)")
    llm.shutdown()
    med = {m: [statistics.median(x[i] for x in v) for i in (0, 1)] for m, v in figures.items()}
    return {
        "wall_s": {m: round(v[0], 2) for m, v in med.items()},
        "decode_attention_s": {m: round(v[1], 2) for m, v in med.items()},
        "wall_x": round(med["gather"][0] / med["flex"][0], 3),
        "decode_attention_x": round(med["gather"][1] / med["flex"][1], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 8, context 512 only")
    parser.add_argument("--candidates", default="flex,flex_grouped,loops")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="128,256,512,1024,2048")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument(
        "--engine", action="store_true", help="the end-to-end A/B instead (engine_ab)"
    )
    parser.add_argument("--rounds", type=int, default=4, help="--engine: rounds")
    parser.add_argument("--requests", type=int, default=32, help="--engine: requests")
    parser.add_argument("--tokens", type=int, default=64, help="--engine: output tokens each")
    args = parser.parse_args()
    if args.engine:
        torch.set_num_threads(int(args.threads.split(",")[0]))
        result = engine_ab(args.rounds, args.requests, args.tokens)
        print(json.dumps({"bench": "cpu_decode_attention", "engine": result}))
        return
    names = args.candidates.split(",")
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.quick:
        batches, contexts = [8], [512]
    torch._dynamo.config.recompile_limit = 1024  # static flex: one compilation per case
    rows = []
    print(
        f"float32, block {BLOCK}, pool >= {POOL_BLOCKS} blocks; median ms per layer, "
        f"interleaved; a flex mask (once per step) amortised over {LAYERS} layers, shown apart"
    )
    print("shape threads batch context ref_ms " + " ".join(f"{n}_ms {n}_x" for n in names))
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        for threads in [int(x) for x in args.threads.split(",")]:
            torch.set_num_threads(threads)
            for batch in batches:
                for context in contexts:
                    case = make_case(shape, batch, context)
                    masks = {n: flex_step for n in names if n == "flex"}
                    if "flex_grouped" in names:
                        masks["flex_grouped"] = flex_grouped_step
                    for name, build in masks.items():
                        case[f"{name}_mask"] = build(case)
                    ref = reference(case)
                    row = {"shape": shape_name, "threads": threads, "batch": batch,
                           "context": context}  # fmt: skip
                    for name in names:
                        t0 = time.perf_counter()
                        got = CANDIDATES[name](case)
                        row[f"{name}_first_s"] = round(time.perf_counter() - t0, 2)
                        row[f"{name}_err"] = float((got - ref).abs().max())
                    reps = args.reps if context * batch <= 8192 else max(5, args.reps // 2)
                    fns = [reference] + [CANDIDATES[n] for n in names] + list(masks.values())
                    ms = ab(fns, case, reps)
                    mask_ms = dict(zip(masks, ms[1 + len(names) :], strict=True))
                    row["ref_ms"] = round(ms[0], 3)
                    for name, m in zip(names, ms[1 : 1 + len(names)], strict=True):
                        row[f"{name}_kernel_x"] = round(ms[0] / m, 2)
                        if name in mask_ms:
                            row[f"{name}_mask_ms"] = round(mask_ms[name], 3)
                            m += mask_ms[name] / LAYERS
                        row[f"{name}_ms"] = round(m, 3)
                        row[f"{name}_x"] = round(ms[0] / m, 2)
                    rows.append(row)
                    print(
                        f"{shape_name} {threads} {batch} {context} {row['ref_ms']:.3f} "
                        + " ".join(
                            f"{row[n + '_ms']:.3f} {row[n + '_x']:.2f}"
                            f" (first {row[n + '_first_s']}s err {row[n + '_err']:.1e})"
                            for n in names
                        ),
                        flush=True,
                    )
    print(json.dumps({"bench": "cpu_decode_attention", "rows": rows}))


if __name__ == "__main__":
    main()
