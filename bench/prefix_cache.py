"""Benchmark: automatic prefix caching on a shared-system-prompt workload (issue 3).

Each request is a 1,024-token shared prefix followed by 64 unique tokens. Requests arrive one
after another (each submitted when the previous one has its first token), so the time to first
token (TTFT) of each is measured alone; the same run is repeated with caching off. Reported:
the TTFT speedup, the share of prefill tokens caching saved, and the achieved hit rate against
the highest possible for the workload (every full block of the shared prefix hit by every
request after the first).

Run: ``python -m bench.prefix_cache [--quick]``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.throughput import model_dir
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

SHARED = 1024
UNIQUE = 64
BLOCK = 16


def workload(num_requests: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(16, vocab, (SHARED,), generator=gen).tolist()
    return [
        shared + torch.randint(16, vocab, (UNIQUE,), generator=gen).tolist()
        for _ in range(num_requests)
    ]


def run(path, prompts, caching: bool) -> dict[str, float]:
    llm = LLM(
        EngineConfig(
            model=str(path),
            enable_prefix_caching=caching,
            num_kv_blocks=2048,
            max_num_batched_tokens=2048,
        )
    )
    engine = llm.engine
    llm.generate([EngineRequest("warm", [20] * 40, SamplingParams(temperature=0, max_tokens=2))])
    engine.kv.stats.reset()
    ttfts, computed = [], 0
    for i, prompt in enumerate(prompts):
        engine.add_request(
            EngineRequest(f"r{i}", list(prompt), SamplingParams(temperature=0, max_tokens=1))
        )
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    ttfts.append(time.perf_counter() - t0)
                    computed += len(prompt) - out.num_cached_tokens
    return {
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_after_first_s": statistics.fmean(ttfts[1:]),
        "prefill_tokens": computed,
        "hit_rate": engine.kv.stats.hit_rate(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 requests (< 60 s)")
    args = parser.parse_args()
    n = 6 if args.quick else 24
    path = model_dir()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = workload(n, vocab)
    on = run(path, prompts, caching=True)
    off = run(path, prompts, caching=False)
    total = n * (SHARED + UNIQUE)
    max_hit = (n - 1) * (SHARED // BLOCK) * BLOCK / total
    print(f"{n} requests: {SHARED}-token shared prefix + {UNIQUE} unique tokens, model {path.name}")
    print(
        f"{'caching':<10}{'TTFT mean ms':>14}{'TTFT 2nd+ ms':>14}{'prefill tokens':>16}"
        f"{'hit rate':>10}"
    )
    for name, r in (("on", on), ("off", off)):
        print(
            f"{name:<10}{r['ttft_mean_s'] * 1e3:>14.1f}{r['ttft_after_first_s'] * 1e3:>14.1f}"
            f"{r['prefill_tokens']:>16}{r['hit_rate']:>10.3f}"
        )
    print(f"highest possible hit rate for this workload: {max_hit:.3f}")
    print(
        json.dumps(
            {
                "ttft_speedup": round(off["ttft_mean_s"] / on["ttft_mean_s"], 2),
                "ttft_speedup_after_first": round(
                    off["ttft_after_first_s"] / on["ttft_after_first_s"], 2
                ),
                "prefill_tokens_saved_fraction": round(
                    1 - on["prefill_tokens"] / off["prefill_tokens"], 4
                ),
                "hit_rate": round(on["hit_rate"], 4),
                "max_hit_rate": round(max_hit, 4),
                "ttft_ms_on": round(on["ttft_mean_s"] * 1e3, 1),
                "ttft_ms_off": round(off["ttft_mean_s"] * 1e3, 1),
                "requests": n,
            }
        )
    )


if __name__ == "__main__":
    main()
