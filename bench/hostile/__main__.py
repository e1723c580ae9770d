"""``python -m bench.hostile [--quick]``: issue 13's hostile workload against a live server.

Starts ``loraplex serve`` (the built-in tiny LLaVA, SQLite) on loopback in its own process, then:

1. sends every hostile request of :mod:`bench.hostile.attacks` and counts 500s; checks the engine
   still serves afterwards;
2. measures a bystander tenant's latency idle and while another tenant sends the most expensive
   requests the API accepts (:mod:`bench.hostile.latency`);
3. measures the bystander's TTFT idle and while another tenant holds 1,000 streams (200 with
   ``--quick``);
4. runs the parts that need their own servers: hostile uploads (peak RSS), adapter-config
   patterns (validation time), slow transports, and usage durability under SIGKILL and a
   database outage, each where its module is present.

The hostile tenant gets limits an operator would give a big customer (no rate limit, 10,000
concurrent requests), and the server admits up to 4,096 outstanding requests with no per-tenant
share, so the engine's own fairness is what is measured. Prints a table, then one JSON line
with ``bystander_latency_ratio``, ``usage_rows_lost_sigkill``, ``usage_rows_lost_db_outage``,
``peak_rss_mb_hostile_uploads``, ``fair_share_ttft_ratio``, ``status_500_count`` and
``engine_survived``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.hostile import attacks, latency
from bench.hostile.live import ADMIN_KEY, LiveServer, init_tiny

BIG_CUSTOMER = {
    "requests_per_minute": 1_000_000,
    "tokens_per_minute": 1_000_000_000,
    "max_concurrent_requests": 10_000,
}


def raise_fd_limit() -> int:
    """Raise the open-files limit to its hard maximum (1,000 streams need 1,000 sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def long_prompt(model_dir: Path, tokens: int) -> str:
    """Text that the model's chat template turns into about ``tokens`` prompt tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)) for _ in range(500)
    ]
    text = ""
    while len(tok.encode(text)) < tokens:
        text += " ".join(rng.choice(words) for _ in range(100)) + " "
    ids = tok.encode(text)[:tokens]
    return tok.decode(ids)


def optional_parts(quick: bool, work: Path) -> dict[str, Any]:
    """The parts in their own modules (uploads, patterns, transport, usage), where present."""
    figures: dict[str, Any] = {}
    for module, call in (
        ("bench.hostile.uploads", "main_figures"),
        ("bench.hostile.patterns", "main_figures"),
        ("bench.hostile.transport", "main_figures"),
        ("bench.hostile.usage", "main_figures"),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        fn = getattr(mod, call, None)
        if fn is None:
            continue
        t0 = time.perf_counter()
        try:
            out = fn(quick=quick, work=work / module.rsplit(".", 1)[1])
        except Exception as exc:  # a part that fails is reported, the others still run
            out = {"error": f"{type(exc).__name__}: {exc}"}
        out[f"{module.rsplit('.', 1)[1]}_seconds"] = round(time.perf_counter() - t0, 1)
        figures.update(out)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and streams")
    args = parser.parse_args()
    raise_fd_limit()
    streams = 200 if args.quick else 1000
    samples = 8 if args.quick else 30
    work = Path(tempfile.mkdtemp(prefix="loraplex-hostile-"))
    model = init_tiny(work / "model")
    server = LiveServer(
        work / "server",
        model,
        ["--served-model-name", "tiny-llava", "--max-outstanding-requests", "4096"]
        + ["--tenant-share", "1"],
    )
    results: dict[str, Any] = {}
    with server:
        hostile = server.create_tenant("hostile")
        bystander = server.create_tenant("bystander")
        server.set_limits(hostile["id"], **BIG_CUSTOMER)
        max_model_len = 4096
        r = attacks.run(server.base_url, hostile["api_key"], ADMIN_KEY, max_model_len)
        results.update(status_500_count=r["status_500_count"], engine_survived=r["engine_survived"])
        print("hostile requests (status per request):")
        for name, status in r["statuses"].items():
            print(f"  {status:>4}  {name}")
        prompt = long_prompt(model, max_model_len - 64)
        bodies = latency.expensive_bodies(prompt, max_images=8)
        host, port = "127.0.0.1", server.port
        load = asyncio.run(
            latency.bystander_under_expensive_load(
                host,
                port,
                bystander["api_key"],
                hostile["api_key"],
                bodies,
                samples=samples,
                workers=4,
            )
        )
        results["bystander_latency_ratio"] = round(load["bystander_latency_ratio"], 2)
        fair = asyncio.run(
            latency.ttft_under_many_streams(
                host,
                port,
                bystander["api_key"],
                hostile["api_key"],
                streams=streams,
                samples=samples,
            )
        )
        results["fair_share_ttft_ratio"] = round(fair["fair_share_ttft_ratio"], 2)
        results["engine_survived"] = results["engine_survived"] and server.alive
        rss, peak = server.rss_mb()
    print("\nbystander chat latency, idle vs expensive load (4 hostile clients):")
    print(f"  idle   p50 {load['idle']['p50_ms']:8.1f} ms  p90 {load['idle']['p90_ms']:8.1f} ms")
    print(
        f"  loaded p50 {load['loaded']['p50_ms']:8.1f} ms  p90 {load['loaded']['p90_ms']:8.1f} ms"
    )
    print(f"  hostile statuses: {load['hostile_statuses']}")
    print(
        f"bystander TTFT, idle vs {streams} hostile streams "
        f"({fair['hostile_streams_started']} had their first token):"
    )
    print(f"  idle   p50 {fair['idle']['p50_ms']:8.1f} ms  p90 {fair['idle']['p90_ms']:8.1f} ms")
    print(
        f"  loaded p50 {fair['loaded']['p50_ms']:8.1f} ms  p90 {fair['loaded']['p90_ms']:8.1f} ms"
    )
    print(f"server RSS {rss:.0f} MiB (peak {peak:.0f} MiB)")
    results.update(optional_parts(args.quick, work))
    for key in (
        "usage_rows_lost_sigkill",
        "usage_rows_lost_db_outage",
        "peak_rss_mb_hostile_uploads",
    ):
        results.setdefault(key, None)
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
