"""Benchmark: what the gateway adds over calling the engine directly, with an instant engine.

The real app (``build_gateway``: key auth, body parsing and validation, rate limiter, usage rows
in SQLite, metrics, OpenAI JSON and SSE) runs under uvicorn as ``loraplex serve`` runs it (same
defaults: uvloop and httptools, the access log on), in its own process on loopback, with
:class:`bench.fake_engine.InstantEngine` in place of the engine and no rate limits. The clients
run in this process (on uvloop): C workers at once (C = 1, 32, 256), each with its own keep-alive
connection through :class:`bench.http_client.LeanHTTPClient`, a minimal HTTP/1.1 client in the
spirit of ``wrk``: the clients share the 2 cores with the server, and aiohttp's own 0.35-0.6 ms
of CPU per request was taken from the server being measured. A request counts until its whole
response is read (for a stream: through ``data: [DONE]``).

Two loads per level, same run:

- closed loop (each worker sends its next request as soon as the last is answered): the
  sustained requests per second (``rps_C``). Its latency is mostly queueing (about C / rate
  with an instant engine) and is shown as "sat" (saturated);
- paced at half that rate (each worker starts a request every ``C / (0.5 * rps_C)`` s): the
  latency a request sees at C concurrent clients when the gateway is not saturated. The paced
  load runs in ``PACED_ROUNDS`` rounds back to back; each percentile reported is the median of
  the rounds' (and the table shows the rounds' range). This VM's speed moves 2x between rounds
  of a few seconds (the ``/health`` floor alone: 0.65-1.4 ms), far more than the gateway changes
  measured; one slow round no longer decides the figure, as with ``pyperf``'s median of runs.

The baseline calls the same fake engine's ``process`` + ``generate`` directly in this process
with C concurrent callers. Added latency (``p50_added_ms_C``, ``p99_added_ms_C``) = paced
gateway percentile - direct percentile. It includes the HTTP client's own cost (shown with the
``GET /health`` floor, and as client CPU per request); the server's CPU per request is read from
``/proc``.

Run: ``python -m bench.gateway [--quick]``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.fake_engine import InstantEngine
from bench.http_client import LeanHTTPClient
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

CONCURRENCY = (1, 32, 256)
MODEL = "instant"
MAX_TOKENS = 16
PACED_LOAD = 0.5  # latency is measured at this fraction of the closed-loop rate
PACED_ROUNDS = 5  # paced rounds per level (each half a phase long); percentiles: the median round's
ADMIN_ENV = "LORAPLEX_ADMIN_KEY"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": "What is the capital of France? " * 6},
]


def build_fake(data_dir: str, admin_key: str, port: int = 8000) -> tuple[Any, Any, InstantEngine]:
    """The real gateway app over the instant engine: SQLite in ``data_dir``, no rate limits.

    Returns:
        ``(app, state, engine)`` from ``build_gateway`` (the database migrated).
    """
    from loraplex.gateway.db.session import db_url
    from loraplex.gateway.server.build import build_gateway
    from loraplex.gateway.server.config import GatewayConfig

    config = GatewayConfig(
        data_dir=Path(data_dir),
        db_url=db_url(data_dir),
        served_model_name=MODEL,
        port=port,
        default_requests_per_minute=None,
        default_tokens_per_minute=None,
        default_max_concurrent_requests=None,
    )
    engine = InstantEngine(MODEL)
    app, state = build_gateway(config, engine, admin_key=admin_key)
    return app, state, engine


def serve_fake(port: int, data_dir: str) -> None:
    """The child process: ``loraplex serve``'s app and uvicorn settings, the instant engine."""
    from loraplex.gateway.auth.redact import RedactingFilter
    from loraplex.gateway.transport.access_log import AccessLog
    from loraplex.gateway.transport.graceful import GracefulServer
    from loraplex.gateway.transport.uvicorn_config import uvicorn_config

    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().addFilter(RedactingFilter())
    app, state, _ = build_fake(data_dir, os.environ[ADMIN_ENV], port)
    config = uvicorn_config(
        AccessLog(app),  # as serve at its default --log-level info
        state.config,  # serve's protocol and connection limits, on 127.0.0.1:port
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=120,  # paced clients at 256 may idle past uvicorn's default 5 s
    )
    GracefulServer(config, state).run()


class Server:
    """The gateway child process on a free loopback port."""

    def __init__(self, data_dir: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.admin_key = "lpx-admin-bench-" + os.urandom(16).hex()
        self.log = open(data_dir / "server.log", "w")  # noqa: SIM115 (closed in stop)
        code = f"from bench.gateway import serve_fake; serve_fake({self.port}, {str(data_dir)!r})"
        env = {**os.environ, ADMIN_ENV: self.admin_key}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=self.log, stderr=subprocess.STDOUT, env=env
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Poll ``/health`` until 200.

        Raises:
            RuntimeError: the process exited or did not answer within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited; see {self.log.name}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the gateway did not start")

    def create_tenant(self) -> str:
        """A tenant through the admin API; its API key."""
        r = httpx.post(
            f"{self.base_url}/admin/tenants",
            json={"name": "bench"},
            headers={"Authorization": f"Bearer {self.admin_key}"},
        )
        r.raise_for_status()
        return r.json()["api_key"]

    def stop(self) -> None:
        """SIGTERM (graceful shutdown), then kill after 10 s."""
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


async def run_load(
    calls: list, seconds: float, rate: float | None = None, server_pid: int | None = None
) -> dict:
    """One worker per entry of ``calls`` (a client each) for ``seconds``.

    Closed loop when ``rate`` is None (each worker sends its next request as soon as the last
    one is answered); otherwise paced: each worker starts one request every
    ``len(calls) / rate`` seconds (random phase; a late answer delays only that worker).

    Returns:
        ``{"p50_ms", "p99_ms", "rps", "count", "client_cpu_ms", "server_cpu_ms"}``: latency of
        the requests sent in the window, completed requests per second, and CPU per request of
        this process and of the server process.
    """
    rng = random.Random(0)
    latencies: list[float] = []
    interval = None if rate is None else len(calls) / rate

    async def worker(call) -> None:
        now = time.perf_counter()
        next_start = now + (rng.uniform(0, interval) if interval else 0.0)
        while True:
            if interval:
                await asyncio.sleep(max(0.0, next_start - time.perf_counter()))
            start = time.perf_counter()
            if start >= deadline:
                return
            await call()
            latencies.append(time.perf_counter() - start)
            if interval:
                next_start = max(next_start + interval, time.perf_counter())

    server_cpu = process_cpu_seconds(server_pid) if server_pid else 0.0
    client_cpu = time.process_time()
    begin = time.perf_counter()
    deadline = begin + seconds
    await asyncio.gather(*(worker(call) for call in calls))
    elapsed = time.perf_counter() - begin
    client_cpu = time.process_time() - client_cpu
    server_cpu = process_cpu_seconds(server_pid) - server_cpu if server_pid else 0.0
    if not latencies:
        raise RuntimeError("no request completed in the window")
    latencies.sort()
    n = len(latencies)
    return {
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "rps": n / elapsed,
        "count": n,
        "client_cpu_ms": client_cpu / n * 1e3,
        "server_cpu_ms": server_cpu / n * 1e3,
    }


def median_of_rounds(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds, plus ``"<figure>_range"``: (lowest, highest).

    Args:
        rounds: ``run_load`` results of the same load, one per round (an odd count).
    """
    merged: dict = {}
    for key in rounds[0]:
        values = sorted(r[key] for r in rounds)
        merged[key] = values[len(values) // 2]
        merged[f"{key}_range"] = (values[0], values[-1])
    return merged


def _span(low_high: tuple[float, float]) -> str:
    return f"{low_high[0]:.1f}-{low_high[1]:.1f}"


def direct_call(engine: InstantEngine):
    """The baseline: ``process`` then ``generate`` to the end, in this process."""
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    counter = iter(range(1 << 62))

    async def call() -> None:
        prompt = await engine.process(MESSAGES)
        request = EngineRequest(
            request_id=f"direct-{next(counter)}",
            prompt_token_ids=prompt.prompt_token_ids,
            sampling=sampling,
            cache_salt="bench",
        )
        async for out in engine.generate(request):
            if out.finished:
                assert out.outputs[0].finish_reason == "length"

    return call


def gateway_call(client: LeanHTTPClient, stream: bool):
    """One chat request through the gateway; checks the answer is complete."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    request = client.encode(
        "POST", "/v1/chat/completions", json.dumps(body).encode(), "application/json"
    )

    async def call() -> None:
        r = await client.send(request)
        if r.status != 200:
            raise RuntimeError(f"bad answer {r.status}: {r.body[:200]!r}")
        if not stream:
            answer = json.loads(r.body)
            if answer["usage"]["completion_tokens"] != MAX_TOKENS:
                raise RuntimeError(f"short answer: {answer}")
        elif not r.body.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"stream did not end with [DONE]: {r.body[-80:]!r}")

    return call


def health_call(client: LeanHTTPClient):
    """``GET /health``: the HTTP floor (uvicorn, routing; no auth, no engine)."""
    request = client.encode("GET", "/health")

    async def call() -> None:
        r = await client.send(request)
        if r.status != 200:
            raise RuntimeError(f"/health {r.status}")

    return call


async def open_client(port: int, api_key: str) -> LeanHTTPClient:
    """One client: one keep-alive connection to the server on loopback, connected.

    A lean client (:mod:`bench.http_client`): it shares the 2 cores with the server, and
    aiohttp's 0.35-0.6 ms of CPU per request was a third of the latency it reported at 1 client.
    """
    client = LeanHTTPClient("127.0.0.1", port, [("Authorization", f"Bearer {api_key}")])
    await client.connect()
    return client


async def measure(server: Server, api_key: str, variants: tuple[str, ...], seconds: float) -> dict:
    """``{(variant, concurrency, "closed" | "paced"): figures}`` for every level."""
    results = {}
    engine = InstantEngine(MODEL)
    pid = server.proc.pid
    for c in CONCURRENCY:
        direct = [direct_call(engine) for _ in range(c)]
        results["direct", c, "closed"] = await run_load(direct, seconds / 4)
        clients = list(await asyncio.gather(*(open_client(server.port, api_key) for _ in range(c))))
        try:
            health = [health_call(client) for client in clients]
            await asyncio.gather(*(call() for call in health))  # warm up
            results["health", c, "closed"] = await run_load(health, seconds / 2, None, pid)
            for variant in variants:
                print(f"{variant}, {c} clients ...", file=sys.stderr, flush=True)
                calls = [gateway_call(client, variant == "stream") for client in clients]
                await asyncio.gather(*(call() for call in calls))  # warm up
                closed = await run_load(calls, seconds, None, pid)
                results[variant, c, "closed"] = closed
                rate = PACED_LOAD * closed["rps"]
                rounds = [
                    await run_load(calls, seconds / 2, rate, pid) for _ in range(PACED_ROUNDS)
                ]
                results[variant, c, "paced"] = median_of_rounds(rounds)
        finally:
            await asyncio.gather(*(client.close() for client in clients))
    return results


def run_async(coro):
    """Run the clients on uvloop when it is installed (as the server does), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="streamed requests only, 2 s per phase (< 60 s)"
    )
    args = parser.parse_args()
    variants, seconds = (("stream",), 2.0) if args.quick else (("stream", "json"), 8.0)
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-gateway-") as tmp:
        server = Server(Path(tmp))
        try:
            server.wait_ready()
            api_key = server.create_tenant()
            results = run_async(measure(server, api_key, variants, seconds))
        except BaseException:
            server.stop()
            log = (Path(tmp) / "server.log").read_text().splitlines()
            print("\n".join(["gateway log (tail):", *log[-20:]]), file=sys.stderr)
            raise
        server.stop()

    print(
        f"gateway vs direct engine (instant fake engine, {MAX_TOKENS} completion tokens), "
        f"{os.cpu_count()} CPUs. ms; 'added' = gateway - direct at the same clients."
    )
    print(
        f"{'clients':>7} {'variant':<8}{'req/s':>8}{'sat p50':>9}{'sat p99':>9}"
        f"{'p50':>8}{'p99':>8}{'p50 add':>9}{'p99 add':>9}{'srv cpu':>9}{'cli cpu':>9}"
        f"  {'p50 rounds':>12} {'p99 rounds':>12}"
    )
    figures: dict[str, float] = {}
    for c in CONCURRENCY:
        direct = results["direct", c, "closed"]
        print(
            f"{c:>7} {'direct':<8}{direct['rps']:>8.0f}{direct['p50_ms']:>9.3f}"
            f"{direct['p99_ms']:>9.3f}{'':>34}{'':>9}{direct['client_cpu_ms']:>9.3f}"
        )
        health = results["health", c, "closed"]
        print(
            f"{c:>7} {'health':<8}{health['rps']:>8.0f}{health['p50_ms']:>9.2f}"
            f"{health['p99_ms']:>9.2f}{'':>34}{health['server_cpu_ms']:>9.3f}"
            f"{health['client_cpu_ms']:>9.3f}"
        )
        for variant in variants:
            closed, paced = results[variant, c, "closed"], results[variant, c, "paced"]
            p50_added = paced["p50_ms"] - direct["p50_ms"]
            p99_added = paced["p99_ms"] - direct["p99_ms"]
            print(
                f"{c:>7} {variant:<8}{closed['rps']:>8.0f}{closed['p50_ms']:>9.2f}"
                f"{closed['p99_ms']:>9.2f}{paced['p50_ms']:>8.2f}{paced['p99_ms']:>8.2f}"
                f"{p50_added:>9.2f}{p99_added:>9.2f}{closed['server_cpu_ms']:>9.3f}"
                f"{closed['client_cpu_ms']:>9.3f}"
                f"  {_span(paced['p50_ms_range']):>12} {_span(paced['p99_ms_range']):>12}"
            )
            suffix = f"_{c}" if variant == "stream" else f"_json_{c}"
            figures[f"p50_added_ms{suffix}"] = round(p50_added, 3)
            figures[f"p99_added_ms{suffix}"] = round(p99_added, 3)
            worst_p50, worst_p99 = paced["p50_ms_range"][1], paced["p99_ms_range"][1]
            figures[f"p50_added_ms{suffix}_worst_round"] = round(worst_p50 - direct["p50_ms"], 3)
            figures[f"p99_added_ms{suffix}_worst_round"] = round(worst_p99 - direct["p99_ms"], 3)
            figures[f"rps{suffix}"] = round(closed["rps"], 1)
            figures[f"p50_saturated_ms{suffix}"] = round(closed["p50_ms"], 3)
            figures[f"server_cpu_ms_per_request{suffix}"] = round(closed["server_cpu_ms"], 3)
    figures["http_floor_p50_ms_1"] = round(results["health", 1, "closed"]["p50_ms"], 3)
    print(
        "req/s, sat p50/p99: closed loop (saturation). p50/p99 and added: paced at "
        f"{PACED_LOAD:.0%} of that rate, the median of {PACED_ROUNDS} rounds (p50/p99 rounds: "
        "their range, gateway latency). stream: SSE with include_usage, read to [DONE]; json: "
        "stream false; health: GET /health. srv/cli cpu: CPU ms per request of the gateway "
        "process and of this (client) process."
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
