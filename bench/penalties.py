"""Benchmark: the sampler's cost of penalties, ``logit_bias`` and ``min_tokens`` (issue 16 item 2).

One sampler step over ``rows`` rows of a real vocabulary (SmolLM's 49,152 ids; Llama 3's
128,256 with ``--vocab``), every row seeded with temperature 0.8, against the same step with
every row also asking for repetition (over a ``prompt``-token prompt and ``output`` generated
tokens), frequency and presence penalties, a ``logit_bias`` and ``min_tokens``: the worst case,
where no row escapes the processors. Same logits, same run, rounds interleaved; the median of
each is reported. The prompts are tensors made once, as the runner keeps them.

Run: ``python -m bench.penalties [--quick] [--vocab N]``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.sampling.penalties import TokenHistory
from loraplex.engine.sampling.sampler import Sampler, make_generator


def step_ms(sampler: Sampler, logits, params, histories, generators) -> float:
    """One sampler call's wall time in milliseconds."""
    start = time.perf_counter()
    sampler(logits, params, generators, histories=histories)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 rows, 5 rounds (< 10 s)")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size")
    args = parser.parse_args()
    rows, rounds = (16, 5) if args.quick else (64, 15)
    prompt, output, vocab = 2048, 256, args.vocab
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen)
    tokens = [
        torch.randint(0, vocab, (prompt + output,), generator=gen).tolist() for _ in range(rows)
    ]
    histories = [TokenHistory(t, prompt, torch.tensor(t[:prompt])) for t in tokens]
    plain = [SamplingParams(temperature=0.8, seed=i) for i in range(rows)]
    penalized = [
        SamplingParams(
            temperature=0.8,
            seed=i,
            repetition_penalty=1.2,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            logit_bias={5: 2.0, 17: -3.0},
            max_tokens=output + 16,
            min_tokens=output + 1,
        )
        for i in range(rows)
    ]
    sampler = Sampler(eos_token_ids=[2])
    times: dict[str, list[float]] = {"plain": [], "penalized": []}
    for _ in range(rounds + 1):  # the first round warms up
        for name, params, hist in (("plain", plain, None), ("penalized", penalized, histories)):
            gens = [make_generator(i) for i in range(rows)]
            times[name].append(step_ms(sampler, logits, params, hist, gens))
    plain_ms = statistics.median(times["plain"][1:])
    penalized_ms = statistics.median(times["penalized"][1:])
    print(f"sampler step, {rows} rows x {vocab} vocab, prompt {prompt}, output {output}")
    print(f"  plain            {plain_ms:8.1f} ms")
    print(f"  every processor  {penalized_ms:8.1f} ms   ratio {penalized_ms / plain_ms:.2f}")
    print(
        json.dumps(
            {
                "rows": rows,
                "vocab": vocab,
                "prompt_tokens": prompt,
                "output_tokens": output,
                "plain_ms": round(plain_ms, 2),
                "penalized_ms": round(penalized_ms, 2),
                "ratio": round(penalized_ms / plain_ms, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
