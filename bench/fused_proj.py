"""Benchmark: fused q/k/v and gate/up projections against separate ones (issue 30 item 2).

One model, one KV cache, one process: the native model as loaded (``self_attn.qkv_proj`` and
``mlp.gate_up_proj``, one GEMM each: ``engine.models.fused``) and the same model with each
fused module swapped for the separate projections it replaced (their own contiguous weights,
copied from the fused rows: three GEMMs for q/k/v and two for gate/up, exactly the computation
before fusion). The two variants run in interleaved rounds (the order flips every round), so
both see the same machine load; the step is the model's forward pass over a decode batch plus
the logits of its rows (the engine's decode step without scheduling and sampling), through the
torch attention backend, over a paged cache already holding every sequence's context.

Both variants' hidden states are checked equal (float32, within 1e-4) before timing.

Default: the ``smollm-135m`` preset (SmolLM-135M's shape: 30 layers, hidden 576, MLP 1536,
9/3 heads, head_dim 64, random weights, float32), decode batches of 1, 8 and 32 sequences of
256 tokens of context, plus one 256-token prefill chunk; 7 rounds of 5 steps per variant.
``--quick``: the ``tiny`` preset, 3 rounds of 2 steps.

Reported per workload: the median step time of each variant over the rounds (each round's
mean), ``separate / fused`` of those medians, and the median over the rounds of each round's
own ratio (above 1: fused is faster; the per-round ratio is the steadier figure on a shared
machine, where a burst of another job's work lands on one variant's turn).

Run: ``python -m bench.fused_proj [--quick] [--preset P] [--batches 1,8,32] [--context N]
[--prefill N] [--rounds N] [--steps N] [--packed]``. ``--packed``: both variants with every
linear prepacked for oneDNN (``engine.models.packed_linear``), as the engine runs on the CPU.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from bench.presets import PRESETS, preset_dir
from loraplex.engine.attention import get_attention_backend
from loraplex.engine.attention.metadata import step_inputs
from loraplex.engine.kv_cache.block_table import BlockTable
from loraplex.engine.models import load_model
from loraplex.engine.models.fused import FusedLinear
from loraplex.engine.models.packed_linear import pack_linears

BLOCK_SIZE = 16


class SeparateProjections(nn.Module):
    """Stands in for a :class:`FusedLinear` with its projections as separate ``nn.Linear``.

    The model calls ``module.split(module(x))``: here ``forward`` passes ``x`` through and
    ``split`` runs each projection on it, so the model computes what it computed before fusion
    (one GEMM per projection, each output its own contiguous tensor), with no extra copy.

    Args:
        fused: The fused module whose rows the projections copy.
    """

    def __init__(self, fused: FusedLinear) -> None:
        super().__init__()
        self.projections = nn.ModuleList()
        for piece in fused.slices():
            lin = nn.Linear(fused.in_features, piece.out_features, bias=piece.bias is not None)
            lin.weight = nn.Parameter(piece.weight.detach().clone(), requires_grad=False)
            if piece.bias is not None:
                lin.bias = nn.Parameter(piece.bias.detach().clone(), requires_grad=False)
            self.projections.append(lin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The input, unchanged (the projections run in :meth:`split`)."""
        return x

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[T, in] -> ([T, out_k], ...)``: each projection's own GEMM."""
        return tuple(lin(x) for lin in self.projections)


class Variants:
    """Switches a loaded native model between fused and separate projections, in place."""

    def __init__(self, model: nn.Module, packed: bool = False) -> None:
        self.swaps: list[tuple[nn.Module, str, nn.Module, nn.Module]] = []
        for layer in model.model.layers:
            for parent, attr in ((layer.self_attn, "qkv_proj"), (layer.mlp, "gate_up_proj")):
                fused = getattr(parent, attr)
                separate = SeparateProjections(fused)
                if packed:  # the separate projections prepacked as the fused one is
                    pack_linears(separate)
                self.swaps.append((parent, attr, fused, separate))

    def use(self, variant: str) -> None:
        """``fused`` or ``separate``."""
        for parent, attr, fused, separate in self.swaps:
            setattr(parent, attr, fused if variant == "fused" else separate)


def make_step(model, batch: int, context: int, query: int, gen: torch.Generator):
    """One step's KV caches (random context) and inputs: ``(kv_caches, StepInputs)``.

    ``batch`` sequences, each computing ``query`` tokens after ``context - query`` cached ones,
    over block tables of distinct blocks.
    """
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    kv_caches = [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        for _ in range(model.num_layers)
    ]
    chunks = []
    for b in range(batch):
        table = BlockTable(BLOCK_SIZE, range(b * blocks_per_seq, (b + 1) * blocks_per_seq))
        ids = torch.randint(16, model.vocab_size, (query,), generator=gen).tolist()
        chunks.append((ids, context - query, table))
    return kv_caches, step_inputs(chunks, torch.device("cpu"))


@torch.inference_mode()
def run_step(model, kv_caches, inputs, backend) -> torch.Tensor:
    """Forward pass plus the logits of each sequence's last row: the decode step's model work."""
    hidden = model(inputs.input_ids, inputs.positions, kv_caches, inputs.metadata, backend)
    last = torch.tensor(inputs.query_start[1:]) - 1
    model.compute_logits(hidden[last])
    return hidden


def measure(args: argparse.Namespace) -> dict:
    """Time both variants over every workload; see the module docstring."""
    model, _ = load_model(preset_dir(args.preset), torch.float32, "cpu")
    if args.packed:  # every linear on oneDNN-prepacked weights, as the engine runs on the CPU
        pack_linears(model)
    variants = Variants(model, packed=args.packed)
    backend = get_attention_backend("torch")
    gen = torch.Generator().manual_seed(0)
    workloads = [(f"decode, batch {b}", b, 1) for b in args.batches]
    if args.prefill:
        workloads.append((f"prefill, {args.prefill} tokens", 1, args.prefill))
    rows = []
    for label, batch, query in workloads:
        context = max(args.context, query)
        kv_caches, inputs = make_step(model, batch, context, query, gen)
        outs = {}
        for variant in ("fused", "separate"):
            variants.use(variant)
            outs[variant] = run_step(model, kv_caches, inputs, backend)  # warm-up, checked
        torch.testing.assert_close(outs["fused"], outs["separate"], atol=1e-4, rtol=1e-4)
        times: dict[str, list[float]] = {"fused": [], "separate": []}
        for r in range(args.rounds):
            order = ("fused", "separate") if r % 2 == 0 else ("separate", "fused")
            for variant in order:
                variants.use(variant)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    run_step(model, kv_caches, inputs, backend)
                times[variant].append((time.perf_counter() - t0) / args.steps)
        fused = statistics.median(times["fused"])
        separate = statistics.median(times["separate"])
        ratios = [s / f for s, f in zip(times["separate"], times["fused"], strict=True)]
        rows.append(
            {
                "workload": label,
                "fused_ms": round(fused * 1e3, 2),
                "separate_ms": round(separate * 1e3, 2),
                "separate_over_fused": round(separate / fused, 3),
                "median_round_ratio": round(statistics.median(ratios), 3),
                "per_round_ratios": [round(x, 3) for x in ratios],
            }
        )
    variants.use("fused")
    return {
        "preset": args.preset,
        "packed": args.packed,
        "threads": torch.get_num_threads(),
        "context": args.context,
        "rounds": args.rounds,
        "steps": args.steps,
        "rows": rows,
    }


def main() -> None:
    """Parse flags, measure, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny preset, 3 rounds of 2 steps")
    parser.add_argument("--preset", choices=PRESETS, help="model shape (default smollm-135m)")
    parser.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,32)")
    parser.add_argument("--context", type=int, default=None, help="tokens of context (256)")
    parser.add_argument("--prefill", type=int, default=None, help="prefill chunk (256; 0: none)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (7)")
    parser.add_argument("--steps", type=int, default=None, help="steps per round (5)")
    parser.add_argument(
        "--packed",
        action="store_true",
        help="both variants on oneDNN-prepacked weights (the engine's CPU default)",
    )
    args = parser.parse_args()
    quick = args.quick
    args.preset = args.preset or ("tiny" if quick else "smollm-135m")
    args.batches = [int(b) for b in (args.batches or ("1,8" if quick else "1,8,32")).split(",")]
    args.context = args.context or (64 if quick else 256)
    args.prefill = (64 if quick else 256) if args.prefill is None else args.prefill
    args.rounds = args.rounds or (3 if quick else 7)
    args.steps = args.steps or (2 if quick else 5)
    result = measure(args)
    print(f"{args.preset}, float32, {result['threads']} threads, context {args.context}")
    print("| workload | fused ms | separate ms | separate / fused | median round ratio |")
    print("| --- | --- | --- | --- | --- |")
    for row in result["rows"]:
        print(
            f"| {row['workload']} | {row['fused_ms']} | {row['separate_ms']} | "
            f"{row['separate_over_fused']} | {row['median_round_ratio']} |"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
