"""Benchmark: serving latency through the gateway against the engine client directly (issue 15).

The real engine (not ``bench.fake_engine``), in its own process, on the ``bench`` preset of the
built-in text model (26M parameters, random weights; ``--preset smollm-135m`` for SmolLM-135M's
shape). The same 32 chat requests (prompts of 60-200 words, greedy, ``max_tokens`` 48) run as
32 concurrent streams, in two ways, same run, each twice, interleaved (new prompts each round,
the same for both ways, so neither hits its prefix cache), after one untimed full-size round:

- **gateway**: ``loraplex serve`` (a child process with its own engine core process), driven
  over HTTP with streaming (``stream: true``) by this process with httpx;
- **direct**: the engine's front (``engine.client.front.AsyncLLM``) in this process over a
  core process client (an engine core process of its own, same flags), its ``generate``
  streams read directly: chat template, tokenizer and detokenizer on this side, no HTTP, no
  auth, no usage ledger.

Reported per way: TTFT (send to first content) and ITL (gaps between successive content
arrivals of one stream) p50 and p99 over all streams, and the ratio gateway/direct of ITL p99
(target <= 1.1). For the gateway also its own ``loraplex_inter_token_latency_seconds``
histogram over each round (outputs as they reach it, before HTTP and the client): the bucket
bounds of its p50 and p99, which separate the server's share of a tail from the client's. A
server-sent event usually carries one token; when the gateway's loop falls behind, one event
may carry several, so a slow gateway shows up as longer gaps, not hidden.

Run: ``python -m bench.serving_latency [--quick] [--preset bench|smollm-135m]``. Prints a table,
then one JSON line. Both ways and this client share the machine's cores: the load average is
printed with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.hostile.live import free_port

ADMIN_KEY = "lpx-admin-bench-serving-latency-0123456789abcdef"
WORDS = "river bridge mountain story light garden window morning city music paper stone".split()


def prompts(num: int, seed: int = 0) -> list[list[dict]]:
    """``num`` single-turn chats of 60-200 words (deterministic)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(num):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 200)))
        out.append([{"role": "user", "content": text}])
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (nearest rank) of ``values``, 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(ttft: list[float], itl: list[float]) -> dict:
    """p50 / p99 of TTFT and ITL in milliseconds."""
    return {
        "ttft_p50_ms": 1000 * percentile(ttft, 0.5),
        "ttft_p99_ms": 1000 * percentile(ttft, 0.99),
        "itl_p50_ms": 1000 * percentile(itl, 0.5),
        "itl_p99_ms": 1000 * percentile(itl, 0.99),
        "streams": len(ttft),
        "gaps": len(itl),
    }


async def via_gateway(base_url: str, api_key: str, chats, max_tokens: int) -> dict:
    """32 concurrent streaming chat requests over HTTP."""
    ttft: list[float] = []
    itl: list[float] = []
    limits = httpx.Limits(max_connections=len(chats), max_keepalive_connections=len(chats))
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:

        async def one(messages):
            body = {
                "model": "bench",
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
            }
            headers = {"Authorization": f"Bearer {api_key}"}
            t0 = time.perf_counter()
            last = None
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    delta = json.loads(line[6:])["choices"]
                    if not delta or not delta[0]["delta"].get("content"):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - t0)
                    else:
                        itl.append(now - last)
                    last = now

        await asyncio.gather(*(one(m) for m in chats))
    return summary(ttft, itl)


async def via_client(client, chats, max_tokens: int) -> dict:
    """The same requests through the engine client's ``generate`` streams."""
    from loraplex.engine.request import EngineRequest
    from loraplex.engine.sampling.params import SamplingParams

    ttft: list[float] = []
    itl: list[float] = []

    async def one(i, messages):
        t0 = time.perf_counter()
        prompt = await client.process(messages, tenant="bench")
        request = EngineRequest(
            f"d{i}-{time.monotonic_ns()}",
            prompt.prompt_token_ids,
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
            images=prompt.images,
            tenant="bench",
            cache_salt="bench",
        )
        last = None
        async for out in client.generate(request):
            if not out.outputs or not out.outputs[0].text:
                continue
            now = time.perf_counter()
            if last is None:
                ttft.append(now - t0)
            else:
                itl.append(now - last)
            last = now

    await asyncio.gather(*(one(i, m) for i, m in enumerate(chats)))
    return summary(ttft, itl)


def itl_buckets(base_url: str) -> dict[float, float]:
    """The gateway's own ``loraplex_inter_token_latency_seconds`` cumulative bucket counts.

    Returns:
        Upper bound (seconds) -> count, summed over every ``model_name``.
    """
    from prometheus_client.parser import text_string_to_metric_families

    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}  # /metrics takes the admin key
    text = httpx.get(f"{base_url}/metrics", headers=auth, timeout=30).text
    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "loraplex_inter_token_latency_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                counts[bound] = counts.get(bound, 0.0) + sample.value
    return counts


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound (ms) of the bucket holding the ``q``-quantile between two scrapes.

    ``before`` and ``after`` are cumulative bucket counts of one histogram; inf when the
    quantile is past the last finite bound.
    """
    bounds = sorted(after)
    delta = [after[b] - before.get(b, 0.0) for b in bounds]
    total = delta[-1] if delta else 0.0
    for bound, count in zip(bounds, delta, strict=True):
        if total and count >= q * total:
            return 1000 * bound
    return float("inf")


def start_server(model: str, data_dir: str, port: int, num_kv_blocks: int) -> subprocess.Popen:
    """``loraplex serve`` as a user runs it, engine core in its own process."""
    cmd = [
        sys.executable,
        "-m",
        "loraplex.gateway.cli",
        "serve",
        "--model",
        model,
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        "--data-dir",
        data_dir,
        "--admin-key",
        ADMIN_KEY,
        "--num-kv-blocks",
        str(num_kv_blocks),
        "--log-level",
        "warning",
        "--no-access-log",
        "--requests-per-minute",
        "100000",
        "--tokens-per-minute",
        "1000000000",
        "--max-concurrent-requests",
        "1000",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("serve did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 streams, 8 tokens, one round")
    parser.add_argument("--preset", choices=["bench", "smollm-135m"], default="bench")
    args = parser.parse_args()
    num, max_tokens, rounds = (8, 8, 1) if args.quick else (32, 48, 2)
    if args.preset == "bench":
        from bench.throughput import model_dir
    else:
        from bench.throughput_smollm import model_dir
    model = str(model_dir())
    num_kv_blocks = 2048
    chats = prompts(num)

    from loraplex.engine.config import EngineConfig
    from loraplex.gateway.server.build import start_engine

    with tempfile.TemporaryDirectory(prefix="loraplex-serving-") as tmp:
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        server = start_server(model, tmp, port, num_kv_blocks)
        direct = None
        try:
            config = EngineConfig(model=model, num_kv_blocks=num_kv_blocks)
            direct = start_engine(config, str(Path(tmp) / "direct-store"), in_process=False)
            wait_healthy(base_url, server)
            r = httpx.post(
                f"{base_url}/admin/tenants",
                json={"name": "bench"},
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                timeout=30,
            )
            api_key = r.json()["api_key"]
            # A full-size warm-up round both ways (allocator growth, first-use costs), not counted.
            asyncio.run(via_gateway(base_url, api_key, chats, max_tokens))
            asyncio.run(via_client(direct, chats, max_tokens))
            results: dict[str, list[dict]] = {"gateway": [], "direct": []}
            for k in range(rounds):  # new prompts each round: no prefix-cache hits
                chats = prompts(num, seed=1 + k)
                before = itl_buckets(base_url)
                run = asyncio.run(via_gateway(base_url, api_key, chats, max_tokens))
                after = itl_buckets(base_url)
                # The gateway's own view (outputs as they reach it, before HTTP): bucket bounds.
                run["server_itl_p50_le_ms"] = bucket_quantile(before, after, 0.5)
                run["server_itl_p99_le_ms"] = bucket_quantile(before, after, 0.99)
                results["gateway"].append(run)
                results["direct"].append(asyncio.run(via_client(direct, chats, max_tokens)))
        finally:
            if direct is not None:
                direct.shutdown()
            server.terminate()
            server.wait(60)
    best = {way: min(runs, key=lambda r: r["itl_p99_ms"]) for way, runs in results.items()}
    ratio = best["gateway"]["itl_p99_ms"] / best["direct"]["itl_p99_ms"]
    load = os.getloadavg()[0]
    print(
        f"model {Path(model).name}; {num} concurrent streams, {max_tokens} tokens each, greedy; "
        f"{rounds} rounds each way, best ITL p99 kept; load {load:.1f}"
    )
    print(f"{'way':<10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}  (ms)")
    for way, r in best.items():
        print(
            f"{way:<10}{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>10.1f}"
            f"{r['itl_p50_ms']:>10.1f}{r['itl_p99_ms']:>10.1f}"
        )
    print(f"ITL p99 gateway/direct: {ratio:.3f} (target <= 1.1)")
    g = best["gateway"]
    print(
        f"the gateway's own ITL histogram (outputs as they reach it, before HTTP): p50 <= "
        f"{g['server_itl_p50_le_ms']:.0f} ms, p99 <= {g['server_itl_p99_le_ms']:.0f} ms "
        "(bucket bounds)"
    )
    print(
        json.dumps(
            {
                "bench": "serving_latency",
                "model": Path(model).name,
                "streams": num,
                "max_tokens": max_tokens,
                "load": load,
                "rounds": results,
                "best": best,
                "itl_p99_ratio": ratio,
            }
        )
    )


if __name__ == "__main__":
    main()
