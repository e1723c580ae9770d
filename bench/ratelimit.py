"""Benchmark: what sharing the rate limits through Redis costs a request (issue 18 item 1).

One admission and one release per request, as the gateway does them, for ``keys`` API keys
with every limit set (requests and tokens per minute high enough never to refuse, a
concurrency limit), ``concurrency`` requests at a time on one event loop: the in-process token
buckets (``gateway.limits.ratelimit``) against the same buckets in Redis
(``gateway.limits.ratelimit_shared``, one Lua script each way, releases sent in the
background) on a ``redis-server`` started on loopback, rounds interleaved, medians reported.
Also how many were refused (none should be), how many the in-process fallback admitted
because Redis failed (none should be), and, as a check of the sharing, that two shared
limiters see one concurrency count.

Run: ``python -m bench.ratelimit [--quick] [--redis-url URL]`` (without a URL it starts Debian's
``redis-server``). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

from loraplex.gateway.limits.ratelimit import RateLimiter, RateLimitExceeded
from loraplex.gateway.limits.ratelimit_shared import SharedRateLimiter
from loraplex.gateway.services.tenants import TenantLimits

LIMITS = TenantLimits(
    requests_per_minute=10**9, tokens_per_minute=10**12, max_concurrent_requests=10**6
)


async def one_round(limiter, requests: int, keys: int, concurrency: int) -> tuple[float, int]:
    """Seconds for ``requests`` admissions and releases, and how many were refused."""
    refused = 0
    queue = list(range(requests))

    async def worker():
        nonlocal refused
        while queue:
            i = queue.pop()
            try:
                ticket = await limiter.acquire(f"bench-key-{i % keys}", LIMITS)
            except RateLimitExceeded:
                refused += 1
                continue
            ticket.release(100)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    if isinstance(limiter, SharedRateLimiter):
        await limiter.drain(timeout=60)
    return time.perf_counter() - start, refused


async def shared_count(url: str) -> int:
    """Two shared limiters: admit on each, count in flight from the first (expect 2)."""
    a, b = SharedRateLimiter(url), SharedRateLimiter(url)
    limits = TenantLimits(max_concurrent_requests=2)
    tickets = [await a.acquire("bench-shared", limits), await b.acquire("bench-shared", limits)]
    count = await a.in_flight("bench-shared")
    for t in tickets:
        t.release(0)
    await a.close()
    await b.close()
    return count


async def run(url: str, requests: int, rounds: int, keys: int, concurrency: int) -> dict:
    """Interleaved rounds of both limiters; the figures (microseconds per request, medians)."""
    local, shared = RateLimiter(), SharedRateLimiter(url)
    times: dict[str, list[float]] = {"in-process": [], "redis": []}
    refused = {"in-process": 0, "redis": 0}
    await one_round(shared, 200, keys, concurrency)  # connections and script cache warm
    for _ in range(rounds):
        for name, limiter in (("in-process", local), ("redis", shared)):
            seconds, n = await one_round(limiter, requests, keys, concurrency)
            times[name].append(seconds / requests * 1e6)
            refused[name] += n
    fallbacks = shared.fallback_admissions
    await shared.close()
    med = {name: statistics.median(v) for name, v in times.items()}
    return {
        "us_per_request_in_process": round(med["in-process"], 1),
        "us_per_request_redis": round(med["redis"], 1),
        "ratio_redis_over_in_process": round(med["redis"] / med["in-process"], 1),
        "requests_per_s_redis": round(1e6 / med["redis"]),
        "refused": refused,
        "fallback_admissions": fallbacks,
        "shared_in_flight_seen": await shared_count(url),
        "requests": requests,
        "rounds": rounds,
        "keys": keys,
        "concurrency": concurrency,
    }


def start_redis(directory: str) -> tuple[subprocess.Popen, str]:
    """A ``redis-server`` on a free loopback port; its process and URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no redis-server: apt-get install redis-server, or pass --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", directory]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.from_url(f"redis://127.0.0.1:{port}/0")
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    client.close()
    return proc, f"redis://127.0.0.1:{port}/0"


def main() -> None:
    """Parse the flags, start Redis unless given one, run, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 requests x 3 rounds")
    parser.add_argument("--redis-url", default=None, help="a Redis to use (its keys are added)")
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    requests, rounds = (2000, 3) if args.quick else (10000, 7)
    proc = None
    with tempfile.TemporaryDirectory() as directory:
        url = args.redis_url
        if url is None:
            proc, url = start_redis(directory)
        try:
            result = asyncio.run(run(url, requests, rounds, args.keys, args.concurrency))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)
    print(f"{'limiter':<12} {'us/request':>11}")
    print(f"{'in-process':<12} {result['us_per_request_in_process']:>11}")
    print(f"{'redis':<12} {result['us_per_request_redis']:>11}")
    print(
        f"redis / in-process: {result['ratio_redis_over_in_process']}x; refused "
        f"{result['refused']}; fallback admissions {result['fallback_admissions']}; two "
        f"limiters see {result['shared_in_flight_seen']} in flight"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
