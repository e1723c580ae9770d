"""Benchmark: model bandwidth utilisation (MBU) of the engine's decode steps (issue 34 item 4).

A decode step of a memory-bound model reads every weight once and every sequence's K and V
once; the fastest it can go is those bytes at the device's copy bandwidth. MBU is that bound
over the measured step: ``(weight bytes + KV bytes of the step) / step time / copy bandwidth``
(issue 34's definition; the bandwidth is the copy bandwidth measured in the same run, as
``bench.kernels`` measures it, not the datasheet's).

- Weight bytes: every parameter of the checkpoint once in the run's dtype (a tied embedding
  once, as the output head; an untied input embedding not at all, a step reads only its
  tokens' rows): ``bench.presets.weight_bytes_read``.
- KV bytes of a step: the sum over its sequences of their context (the positions attended,
  this step's token included) x layers x KV heads x head_dim x 2 (K and V) x dtype bytes.
- Step time: the engine's own per-step record (``EngineCore.step_stats.recent``: the whole
  step, schedule to sampled tokens; and of it the forward pass and logits, synchronised on
  CUDA), over ``--steps`` decode-only steps of ``--batch`` sequences after their prefill and 3
  untimed decode steps. Both are reported: MBU of the step, and of the forward pass alone.
- Copy bandwidth: ``bench.kernels.copy_bandwidth`` (``dst.copy_(src)`` of 1 GiB on a GPU,
  256 MiB on CPU, read + write), timed by ``bench.kernels.timer`` in the same process, before
  the engine is built.

Defaults: on CUDA the ``llama-1b`` preset (1.05B parameters, bfloat16), batch 64, prompts of
1,024 random tokens, 32 timed steps; on CPU the ``bench`` preset, batch 16, context 256, 8
steps; ``--quick`` (CPU smoke): the built-in tiny model, batch 8, context 64, 4 steps.

Run: ``python -m bench.mbu [--quick] [--device cpu|cuda] [--dtype D] [--attention-backend
torch|triton] [--preset P] [--batch N] [--context N] [--steps N]``. Prints a table, then one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.device import Target, add_arguments, target_from_args
from bench.presets import PRESETS, kv_bytes_per_token, preset_dir, weight_bytes_read
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

WARM_STEPS = 3


def defaults(quick: bool, cuda: bool) -> dict:
    """The preset and sizes a run takes when the options leave them out."""
    if cuda:
        return {"preset": "llama-1b", "batch": 64, "context": 1024, "steps": 32}
    if quick:
        return {"preset": "tiny", "batch": 8, "context": 64, "steps": 4}
    return {"preset": "bench", "batch": 16, "context": 256, "steps": 8}


def max_tokens(context: int, steps: int) -> int:
    """Output tokens each sequence asks for: more than it can make before the last timed step.

    The first sequences prefilled decode while the others prefill (a token per step, and the
    engine paces prefills in token-equivalents, so how many steps that takes is its business):
    half the context again is far above it at any batch (the timed steps check it). The
    sequences are aborted after the timed steps.
    """
    return context // 2 + WARM_STEPS + steps + 64


def decode_steps(llm: LLM, batch: int, context: int, steps: int, vocab: int) -> list[dict]:
    """Timed decode-only steps of ``batch`` sequences (see the module docstring).

    Returns:
        One ``{"seconds", "forward_seconds", "context_tokens"}`` per timed step:
        ``context_tokens`` is the sum over the step's sequences of the positions each attends.

    Raises:
        RuntimeError: a timed step was not a pure decode step of all ``batch`` sequences
            (the pool too small, a sequence finished early): its figures would be wrong.
    """
    engine = llm.engine
    gen = torch.Generator().manual_seed(3000 + batch)
    prompts = torch.randint(16, vocab, (batch, context), generator=gen).tolist()
    most = max_tokens(context, steps)
    params = SamplingParams(temperature=0.0, max_tokens=most, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"mbu-{i}", p, params))
    sched = engine.scheduler
    while sched.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in sched.running):
        engine.step()  # the prefills, not timed
    for _ in range(WARM_STEPS):
        engine.step()
    engine.step_stats.reset()
    contexts = []
    for _ in range(steps):
        running = list(sched.running)
        if len(running) != batch or sched.waiting:
            raise RuntimeError(
                f"a timed step would run {len(running)} sequences ({len(sched.waiting)} "
                f"waiting), not the batch of {batch}"
            )
        contexts.append(sum(s.num_computed_tokens + 1 for s in running))
        engine.step()
    recent = list(engine.step_stats.recent)[-steps:]
    if engine.step_stats.num_steps != steps:
        raise RuntimeError(f"{engine.step_stats.num_steps} engine steps for {steps} decodes")
    for i in range(batch):
        engine.abort_request(f"mbu-{i}")
    return [
        {"seconds": s, "forward_seconds": f, "context_tokens": c}
        for (s, f), c in zip(recent, contexts, strict=True)
    ]


def measure(args: argparse.Namespace, target: Target) -> dict:
    """Copy bandwidth, then the engine's decode steps; the figures of the JSON line."""
    from bench.kernels import copy_bandwidth, timer
    from loraplex.engine.models.tiny_model import parameter_count

    copy_bps = copy_bandwidth(target.device, timer(target.device, args.quick))
    target.release()
    path = preset_dir(args.preset)
    cfg = json.loads((path / "config.json").read_text())
    elem = target.torch_dtype.itemsize
    weights = weight_bytes_read(cfg, elem, parameter_count(path))
    per_token = kv_bytes_per_token(cfg, elem)
    step_tokens = max(2048, min(8192, args.batch * args.context))
    most = max_tokens(args.context, args.steps)
    blocks = args.batch * -(-(args.context + most + 1) // 16) + 16
    llm = LLM(
        EngineConfig(
            model=str(path),
            max_num_seqs=args.batch,
            max_num_batched_tokens=step_tokens,
            long_prefill_token_threshold=0,  # the prefills are not measured: no cap
            num_kv_blocks=blocks,
            enable_prefix_caching=False,
            **target.engine(),
        )
    )
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([EngineRequest(f"warm{i}", [20 + i] * 16, warm) for i in range(args.batch)])
    target.reset_peak()
    rows = decode_steps(llm, args.batch, args.context, args.steps, cfg["vocab_size"])
    peak = target.peak_gib()
    llm.shutdown()
    kv = [r["context_tokens"] * per_token for r in rows]
    step_s = sum(r["seconds"] for r in rows)
    forward_s = sum(r["forward_seconds"] for r in rows)
    moved = len(rows) * weights + sum(kv)
    return {
        "bench": "mbu",
        "preset": args.preset,
        "batch": args.batch,
        "context": args.context,
        "steps": args.steps,
        "copy_gbs": round(copy_bps / 1e9, 2),
        "weight_bytes_per_step": weights,
        "kv_bytes_per_step": round(statistics.mean(kv)),
        "step_ms": round(statistics.median(r["seconds"] for r in rows) * 1e3, 3),
        "forward_ms": round(statistics.median(r["forward_seconds"] for r in rows) * 1e3, 3),
        "achieved_gbs": round(moved / step_s / 1e9, 2),
        "achieved_gbs_forward": round(moved / forward_s / 1e9, 2),
        "mbu": round(moved / step_s / copy_bps, 4),
        "mbu_forward": round(moved / forward_s / copy_bps, 4),
        "decode_tokens_per_s": round(args.batch * len(rows) / step_s, 1),
        "overhead_fraction": round(1 - forward_s / step_s, 3),
        "peak_gib": peak,
        **target.figures(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke: tiny model, 4 steps")
    parser.add_argument("--preset", choices=PRESETS, help="the model (default: by device)")
    parser.add_argument("--batch", type=int, help="sequences decoding together")
    parser.add_argument("--context", type=int, help="prompt tokens of each sequence")
    parser.add_argument("--steps", type=int, help="timed decode steps")
    add_arguments(parser)
    args = parser.parse_args()
    target = target_from_args(parser, args)
    for key, value in defaults(args.quick, target.is_cuda).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.batch, args.context, args.steps) < 1:
        parser.error("--batch, --context and --steps must be at least 1")
    torch.manual_seed(0)
    f = measure(args, target)
    print(
        f"model {args.preset}; {target.describe()}; batch {f['batch']}, prompts of "
        f"{f['context']} tokens, {f['steps']} decode steps; copy bandwidth {f['copy_gbs']} GB/s"
    )
    print(f"{'figure':<34}{'step':>12}{'forward':>12}")
    print(f"{'median ms':<34}{f['step_ms']:>12.3f}{f['forward_ms']:>12.3f}")
    print(f"{'achieved GB/s':<34}{f['achieved_gbs']:>12.2f}{f['achieved_gbs_forward']:>12.2f}")
    print(f"{'MBU (of copy bandwidth)':<34}{f['mbu']:>12.3f}{f['mbu_forward']:>12.3f}")
    gb = 1e9
    print(
        f"bytes per step: weights {f['weight_bytes_per_step'] / gb:.3f} GB, KV "
        f"{f['kv_bytes_per_step'] / gb:.3f} GB (mean); decode {f['decode_tokens_per_s']} tok/s; "
        f"engine overhead {f['overhead_fraction']:.3f}; peak "
        f"{'-' if f['peak_gib'] is None else f['peak_gib']} GiB"
    )
    print(json.dumps(f))


if __name__ == "__main__":
    main()
