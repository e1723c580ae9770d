"""``python -m bench.hostile [--quick]``: issue 13's hostile workload against a live server.

Starts ``loraplex serve`` (the built-in tiny LLaVA, SQLite) on loopback in its own process, then:

1. sends every hostile request of :mod:`bench.hostile.attacks` and counts 500s; checks the engine
   still serves afterwards (``status_500_count``, ``engine_survived``); then schema attacks
   (:mod:`.schemas`, issue 27) while a bystander streams: engine-core deaths and the
   bystander's decode rate against idle (``schema_engine_deaths``,
   ``schema_bystander_decode_ratio``);
2. measures a bystander tenant's chat latency idle and while another tenant sends the most
   expensive requests the API accepts (``bystander_latency_ratio``, :mod:`.latency`);
3. measures the bystander's TTFT idle and while another tenant holds 1,000 streams (100 with
   ``--quick``; ``fair_share_ttft_ratio``);
4. three concurrent hostile adapter uploads (``peak_rss_mb_hostile_uploads``, :mod:`.uploads`)
   and slowloris heads and dribbled bodies (:mod:`.transport`) against the same server;
   then never-read streams (:mod:`.never_read`, issue 27) against a second server with the
   finding's ``--max-connections 32``, started alongside the first
   (``connection_table_capture``, ``never_read_bystander_*_ratio``);
5. hostile adapter-config patterns, validated in process (``max_pattern_ms``, :mod:`.patterns`);
6. full run only: usage rows lost when a server is SIGKILLed at random moments of a load, and
   when its PostgreSQL goes away (``usage_rows_lost_sigkill``, ``usage_rows_lost_db_outage``,
   :mod:`.usage`; the outage needs ``LORAPLEX_BENCH_PG_URL`` or ``LORAPLEX_TEST_PG_URL``).

The hostile tenant gets limits an operator would give a big customer (no rate limit, 10,000
concurrent requests, the whole connection table for its key), and the server admits up to 4,096
outstanding requests with no per-tenant share, so what is measured is the engine's and the
gateway's own fairness. Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.hostile import (
    attacks,
    latency,
    never_read,
    patterns,
    schemas,
    transport,
    uploads,
    usage,
)
from bench.hostile.live import ADMIN_KEY, LiveServer, init_tiny

MODEL = "tiny-llava"
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


def timed(name: str, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run one part; its figures plus ``<name>_seconds``, or its error (the others still run)."""
    t0 = time.perf_counter()
    try:
        out = dict(fn(*args, **kwargs))
    except Exception as exc:
        out = {f"{name}_error": f"{type(exc).__name__}: {exc}"}
    out[f"{name}_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one server, fewer samples and streams, no SIGKILL or database-outage rounds",
    )
    args = parser.parse_args()
    raise_fd_limit()
    streams = 100 if args.quick else 1000
    samples = 6 if args.quick else 30
    work = Path(tempfile.mkdtemp(prefix="loraplex-hostile-"))
    model = init_tiny(work / "model")
    flags = ["--served-model-name", MODEL, "--max-outstanding-requests", "4096"]
    flags += ["--tenant-share", "1", "--max-connections-per-key", "1024"]  # 1,000 streams
    if args.quick:  # the transport part waits for the server's deadlines
        flags += ["--header-timeout", "4", "--body-timeout", "4"]
    results: dict[str, Any] = {}
    parked = LiveServer(
        work / "never-read", model, never_read.server_flags(8 if args.quick else None)
    ).spawn()  # loads its model while the first server loads its own
    atexit.register(parked.stop)  # also if a part before it fails
    with LiveServer(work / "server", model, flags) as server:
        hostile = server.create_tenant("hostile")
        bystander = server.create_tenant("bystander")
        server.set_limits(hostile["id"], **BIG_CUSTOMER)
        max_model_len = 4096
        r = attacks.run(server.base_url, hostile["api_key"], ADMIN_KEY, max_model_len)
        results.update(status_500_count=r["status_500_count"], engine_survived=r["engine_survived"])
        print("hostile requests (status per request):")
        for name, status in r["statuses"].items():
            print(f"  {status:>4}  {name}")
        results.update(
            timed(
                "schemas",
                schemas.run,
                server,
                bystander["api_key"],
                hostile["api_key"],
                quick=args.quick,
            )
        )
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
                warmup=1.0 if args.quick else 2.0,
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
        bomb = (64 << 20) if args.quick else uploads.BOMB_BYTES  # both far past the caps
        results.update(timed("uploads", uploads.run, server, hostile["api_key"], bomb))
        moved = timed(
            "transport",
            transport.run,
            server,
            bystander["api_key"],
            k=20 if args.quick else transport.K,
            samples=5 if args.quick else transport.SAMPLES,
        )
        results.update(
            {f"transport_{k}" if "transport" not in k else k: v for k, v in moved.items()}
        )
        alive = server.alive
        with server.client() as c:
            alive = alive and c.get("/health").status_code == 200
        results["engine_survived"] = results["engine_survived"] and alive
        rss, peak = server.rss_mb()
    parked.wait_healthy()
    key = parked.create_tenant("bystander")["api_key"]
    samples = 4 if args.quick else never_read.SAMPLES
    results.update(timed("never_read", never_read.run, parked, key, samples=samples))
    parked.stop()
    results.update(timed("patterns", patterns.run))
    if args.quick:
        note = "full run only (python -m bench.hostile): each round restarts a server"
        results.update(usage_rows_lost_sigkill=None, usage_rows_lost_db_outage=None)
        results["usage_note"] = note
    else:
        results.update(timed("sigkill", usage.sigkill_loss, data_dir=work / "sigkill"))
        results.update(timed("db_outage", usage.db_outage_loss, data_dir=work / "outage"))
    print("\nbystander chat latency, idle vs expensive load (4 hostile clients):")
    for phase in ("idle", "loaded"):
        f = load[phase]
        print(f"  {phase:<6} p50 {f['p50_ms']:8.1f} ms  p90 {f['p90_ms']:8.1f} ms")
    print(f"  hostile statuses: {load['hostile_statuses']}")
    print(
        f"bystander TTFT, idle vs {streams} hostile streams "
        f"({fair['hostile_streams_started']} had their first token):"
    )
    for phase in ("idle", "loaded"):
        f = fair[phase]
        print(f"  {phase:<6} p50 {f['p50_ms']:8.1f} ms  p90 {f['p90_ms']:8.1f} ms")
    print(f"server RSS {rss:.0f} MiB (peak {peak:.0f} MiB)")
    figures = {k: v for k, v in results.items() if not isinstance(v, dict | list)}
    width = max(len(k) for k in figures)
    for key in sorted(figures):
        print(f"{key:<{width}}  {figures[key]}")
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
