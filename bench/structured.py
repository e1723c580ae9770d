"""Benchmark: the cost of structured output (issue 16 item 6).

1. Throughput of one continuous batch where half the rows are ``json_schema``-constrained,
   against the same batch with no row constrained, same run, same prompts, greedy, on the
   ``bench`` preset of the built-in text model (26M parameters, random weights), prefix caching
   off (both batches have the same prompts). The schema (an array of at least 200 enum strings)
   cannot complete before ``max_tokens``, so both batches produce the same number of tokens;
   every constrained output is checked to be a valid JSON prefix of the schema. Two rounds,
   interleaved; the best of each is reported.
2. Schema compile time: cold (a schema never seen: vetted in the grammar sandbox's worker, then
   compiled by the core: llguidance builds its grammar and lexer twice) and
   cached (the template matcher is copied), plus the one-time tokenizer index.

Run: ``python -m bench.structured [--quick]``. Prints a table, then one JSON line. Target: the
half-constrained batch at >= 0.9 of the unconstrained one's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.throughput import model_dir, workload
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest, RequestOutputKind
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.structured_output.grammar import StructuredOutputSpec

SCHEMA = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 200}


def valid_prefix(text: str) -> bool:
    """``text`` is a prefix of a JSON array of SCHEMA's enum strings (cut anywhere)."""
    if not text.startswith("["):
        return False
    items = text[1:].removesuffix("]").split(",")
    words = ('"alpha"', '"beta"', '"gamma"')
    return all(i in words for i in items[:-1]) and any(w.startswith(items[-1]) for w in words)


def run_batch(llm: LLM, prompts, output_tokens: int, constrained_every: int) -> dict:
    """One batch; every ``constrained_every``-th row constrained (0: none). Tokens/s, steps."""
    spec = StructuredOutputSpec.json_schema(SCHEMA)
    engine = llm.engine
    engine.step_stats.reset()
    for i, p in enumerate(prompts):
        constrained = constrained_every and i % constrained_every == 0
        params = SamplingParams(
            temperature=0.0,
            max_tokens=output_tokens,
            ignore_eos=True,
            structured_output=spec if constrained else None,
        )
        engine.add_request(
            EngineRequest(
                f"r{constrained_every}-{i}",
                list(p),
                params,
                output_kind=RequestOutputKind.FINAL_ONLY,  # the whole text at the end
            )
        )
    produced, texts = 0, []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                produced += len(out.outputs[0].token_ids)
                rid = int(out.request_id.rsplit("-", 1)[1])
                if constrained_every and rid % constrained_every == 0:
                    texts.append(out.outputs[0].text)
    elapsed = time.perf_counter() - t0
    for text in texts:
        assert valid_prefix(text), text
    return {
        "tokens_per_s": produced / elapsed,
        "seconds": elapsed,
        "tokens": produced,
        "steps": engine.step_stats.num_steps,
        "constrained_rows": len(texts),
    }


def compile_times(llm: LLM, repeats: int) -> dict:
    """Seconds to compile a never-seen schema (cold) and a seen one (cached)."""
    structured = llm.engine.core.structured
    t0 = time.perf_counter()
    structured.compiler  # noqa: B018 - the one-time tokenizer index
    index = time.perf_counter() - t0
    cold, cached = [], []
    for i in range(repeats):
        schema = {
            "type": "object",
            "properties": {
                f"field_{i}": {"type": "string", "maxLength": 20},
                "n": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
            },
            "required": [f"field_{i}", "n"],
        }
        spec = StructuredOutputSpec.json_schema(schema)
        t0 = time.perf_counter()
        structured.prepare(spec).result()  # vetted in the sandbox, then compiled
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        structured.prepare(spec).result().deep_copy()  # what a new sequence costs
        cached.append(time.perf_counter() - t0)
    return {
        "tokenizer_index_s": index,
        "cold_ms": 1000 * statistics.median(cold),
        "cached_ms": 1000 * statistics.median(cached),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests, 16 tokens (< 30 s)")
    args = parser.parse_args()
    num_requests, output_tokens = (8, 16) if args.quick else (32, 64)
    torch.manual_seed(0)
    path = model_dir()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = workload(num_requests, vocab)
    llm = LLM(EngineConfig(model=str(path), max_num_seqs=num_requests, enable_prefix_caching=False))
    compiled = compile_times(llm, 3 if args.quick else 10)
    run_batch(llm, prompts[:2], 4, 2)  # warm-up, not timed
    rounds = [
        (run_batch(llm, prompts, output_tokens, 0), run_batch(llm, prompts, output_tokens, 2))
        for _ in range(2)
    ]
    free = max((r[0] for r in rounds), key=lambda r: r["tokens_per_s"])
    half = max((r[1] for r in rounds), key=lambda r: r["tokens_per_s"])
    assert free["tokens"] == half["tokens"], (free, half)
    ratio = half["tokens_per_s"] / free["tokens_per_s"]
    print(f"model {path.name}; {num_requests} requests, {output_tokens} output tokens, greedy")
    print(f"{'batch':<28}{'tok/s':>10}{'seconds':>10}{'tokens':>8}{'steps':>7}")
    for name, r in (("unconstrained", free), ("half json_schema", half)):
        print(
            f"{name:<28}{r['tokens_per_s']:>10.1f}{r['seconds']:>10.2f}{r['tokens']:>8}{r['steps']:>7}"
        )
    print(f"ratio half/unconstrained: {ratio:.3f} (target >= 0.9)")
    print(
        f"schema compile: cold {compiled['cold_ms']:.2f} ms, cached {compiled['cached_ms']:.3f} ms "
        f"(median); tokenizer index {compiled['tokenizer_index_s']:.2f} s once"
    )
    print(
        json.dumps(
            {
                "bench": "structured",
                "unconstrained": free,
                "half_constrained": half,
                "ratio": ratio,
                "compile": compiled,
            }
        )
    )


if __name__ == "__main__":
    main()
