"""Hostile transport: slowloris heads and dribbled bodies against a live ``loraplex serve``.

K connections send a request head one byte a second and never finish it (slowloris); K more
send a whole ``POST /v1/chat/completions`` head with a valid key of a hostile tenant and then
dribble the body one byte a second. While they are held, a bystander tenant's latency is
measured (``GET /health`` and a small chat, one keep-alive client, sequential requests) and
compared with the same measurement on the idle server, in the same run. Also measured: whether
the hostile tenant can still chat while its K bodies dribble (the body is read before the key's
concurrency slot is taken, so it can: 200, not 429), the server's RSS, and, once the server's
header and body deadlines have passed, how many hostile connections it still holds (0 expected;
each one is either answered 408 or closed).

``run(server, key)`` takes a started :class:`bench.hostile.live.LiveServer` and the bystander's
key; it reads the server's ``--header-timeout`` / ``--body-timeout`` from its flags (else the
defaults) to know how long to wait. Bounded: about ``max(header, body timeout) + 15`` s.

The never-read-streams case (issue 27: streams whose sockets are never read, which held the
connection table) is :mod:`bench.hostile.never_read`, against a second server with the
finding's ``--max-connections 32``.

Run alone: ``python -m bench.hostile.transport [--quick] [--never-read-keys N]`` starts both
servers at once (the built-in tiny model, default limits but the never-read server's table;
``--quick``: 6 s deadlines, K = 50, a 10 s ``--write-timeout``), prints a table and one JSON
line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.hostile import never_read
from bench.hostile.live import LiveServer, init_tiny
from loraplex.gateway.server.config import GatewayConfig

K = 150  # slowloris connections, and as many slow bodies
SAMPLES = 25  # bystander chats per phase (idle before, hostile, idle after)
HEALTH_PER_CHAT = 4  # bystander /health requests before each chat
DRIBBLE_EVERY = 1.0  # seconds between two hostile bytes
MARGIN = 6.0  # seconds past the server's deadlines before counting what it still holds
BODY_LENGTH = 100_000  # the slow bodies' announced Content-Length
CPU_WINDOW = 2.0  # seconds over which the server's CPU use is read, with no bystander traffic


def server_deadlines(server: LiveServer) -> tuple[float, float]:
    """``(header timeout, body timeout)`` of ``server``: its flags, else the defaults."""
    d = GatewayConfig(data_dir=Path("."), db_url="", served_model_name="")
    found = {"--header-timeout": d.header_timeout_seconds, "--body-timeout": d.body_timeout_seconds}
    args = server.args
    for i, arg in enumerate(args[:-1]):
        if arg in found:
            found[arg] = float(args[i + 1])
    return found["--header-timeout"], found["--body-timeout"]


class Hostile:
    """K slowloris and K slow-body connections, driven by an event loop in a child process.

    A child process, so that the bystander measured in this one never waits for the GIL
    behind the driver (a thread here added up to the 5 ms switch interval to its latency).

    Attributes:
        outcomes: After :meth:`join`, per connection ``(kind, how it ended)``: ``"408"``
            (answered 408), ``"closed"`` (closed or reset without an answer), ``"other NNN"``,
            ``"open"`` (still held when the run stopped), ``"refused"`` (could not connect).
    """

    def __init__(self, port: int, key: str, model: str, k: int, stop_at: float) -> None:
        self.stop_at = stop_at
        self.outcomes: list[tuple[str, str]] = []
        slow_body = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n" % (key.encode(), BODY_LENGTH)
        ) + b'{"model": "%s", "messages": [' % model.encode()
        context = multiprocessing.get_context("spawn")
        self._connected = context.Event()
        self._results = context.Queue()
        self._process = context.Process(
            target=_drive,
            args=(port, slow_body, k, stop_at, self._connected, self._results),
            daemon=True,
        )

    def start(self) -> Hostile:
        """Open every connection (returns once they are all open or refused)."""
        self._process.start()
        if not self._connected.wait(120):
            raise RuntimeError("the hostile connections did not open")
        return self

    def join(self) -> None:
        """Wait for the driver to stop (every connection ended, or ``stop_at``)."""
        self.outcomes = self._results.get(timeout=max(1.0, self.stop_at - time.monotonic() + 60))
        self._process.join(10)


def _drive(port, slow_body, k, stop_at, connected, results) -> None:
    """The child process: hold the connections, put their outcomes on ``results``."""
    slow_head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-a"

    async def hold(kind: str, ready: asyncio.Future) -> tuple[str, str]:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(slow_head if kind == "slowloris" else slow_body)
            await writer.drain()
        except OSError:
            ready.set_result(None)
            return kind, "refused"
        ready.set_result(None)
        try:
            while True:
                left = stop_at - time.monotonic()
                if left <= 0:
                    return kind, "open"
                try:
                    data = await asyncio.wait_for(reader.read(65536), min(left, DRIBBLE_EVERY))
                except TimeoutError:
                    writer.write(b"a" if kind == "slowloris" else b" ")
                    await writer.drain()
                    continue
                if not data:
                    return kind, "closed"
                status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "?"
                return kind, "408" if status == "408" else f"other {status}"
        except (ConnectionError, OSError):
            return kind, "closed"
        finally:
            writer.close()

    async def main() -> list[tuple[str, str]]:
        loop = asyncio.get_running_loop()
        opened = [loop.create_future() for _ in range(2 * k)]
        tasks = [
            asyncio.create_task(hold("slowloris" if i < k else "slow_body", opened[i]))
            for i in range(2 * k)
        ]
        await asyncio.gather(*opened)
        connected.set()
        return list(await asyncio.gather(*tasks))

    results.put(asyncio.run(main()))


def _latencies(client: httpx.Client, model: str, n: int) -> dict[str, list[float]]:
    """``n`` small chats, each after ``HEALTH_PER_CHAT`` ``/health``: ms each (statuses checked)."""
    out: dict[str, list[float]] = {"health": [], "chat": []}
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    for _ in range(n):
        for _ in range(HEALTH_PER_CHAT):
            t = time.perf_counter()
            r = client.get("/health")
            out["health"].append((time.perf_counter() - t) * 1e3)
            if r.status_code != 200:
                raise RuntimeError(f"bystander /health: {r.status_code}")
        t = time.perf_counter()
        r = client.post("/v1/chat/completions", json=body)
        out["chat"].append((time.perf_counter() - t) * 1e3)
        if r.status_code != 200:
            raise RuntimeError(f"bystander chat: {r.status_code} {r.text[:200]}")
    return out


def _server_cpu_ms_per_s(server: LiveServer, seconds: float) -> float:
    """The server process's CPU time (user + system) per wall second over ``seconds`` (ms/s)."""
    assert server.proc is not None
    stat = Path(f"/proc/{server.proc.pid}/stat")
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        fields = stat.read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime

    c0, t0 = cpu(), time.monotonic()
    time.sleep(seconds)
    return (cpu() - c0) / (time.monotonic() - t0) * 1e3


def run(server: LiveServer, key: str, k: int = K, samples: int = SAMPLES) -> dict[str, Any]:
    """Hold ``k`` slowloris and ``k`` slow-body connections; measure a bystander (``key``).

    The bystander's idle latencies are measured before the hostile connections open and after
    the server has cut them, pooled (this VM's speed drifts between the two); the hostile ones
    while they are all held (``measured_while_held``).

    Returns:
        The figures (see the module docstring): bystander p50 latencies idle and under the
        hostile connections (ms) and their ratios, the hostile tenant's chat status meanwhile,
        how the hostile connections ended and how many the server still held after its
        deadlines, the server's RSS (MiB) idle and during.
    """
    header_timeout, body_timeout = server_deadlines(server)
    hostile_key = server.create_tenant(f"hostile-transport-{time.time_ns()}")["api_key"]
    with server.client(key, timeout=60) as bystander:
        model = bystander.get("/v1/models").json()["data"][0]["id"]
        _latencies(bystander, model, 2)  # warm-up
        before = _latencies(bystander, model, samples)
        rss_idle = server.rss_mb()[0]
        cpu_idle = _server_cpu_ms_per_s(server, CPU_WINDOW)
        started = time.monotonic()
        stop_at = started + max(header_timeout, body_timeout) + MARGIN
        hostile = Hostile(server.port, hostile_key, model, k, stop_at).start()
        opened_s = time.monotonic() - started
        cpu_hostile = _server_cpu_ms_per_s(server, CPU_WINDOW)  # the hostile connections only
        during = _latencies(bystander, model, samples)
        measured_s = time.monotonic() - started
        rss_during = server.rss_mb()[0]
        with server.client(hostile_key, timeout=60) as h:
            chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
            hostile_chat = h.post("/v1/chat/completions", json={**chat, "max_tokens": 2})
        hostile.join()
        after = _latencies(bystander, model, samples)
    idle = {kind: before[kind] + after[kind] for kind in before}
    ended: dict[str, int] = {}
    for _, how in hostile.outcomes:
        ended[how] = ended.get(how, 0) + 1
    p50 = {
        f"{kind}_{phase}": statistics.median(v[kind])
        for phase, v in (("idle", idle), ("hostile", during))
        for kind in ("health", "chat")
    }
    return {
        "slowloris_connections": k,
        "slow_body_connections": k,
        "open_seconds": round(opened_s, 2),
        "bystander_health_p50_ms_idle": round(p50["health_idle"], 2),
        "bystander_health_p50_ms_hostile": round(p50["health_hostile"], 2),
        "bystander_chat_p50_ms_idle": round(p50["chat_idle"], 2),
        "bystander_chat_p50_ms_hostile": round(p50["chat_hostile"], 2),
        "bystander_health_ratio": round(p50["health_hostile"] / p50["health_idle"], 2),
        "bystander_chat_ratio": round(p50["chat_hostile"] / p50["chat_idle"], 2),
        "measured_while_held": measured_s < min(header_timeout, body_timeout),
        "hostile_tenant_chat_status_during": hostile_chat.status_code,
        "hostile_ended": dict(sorted(ended.items())),
        "hostile_held_after_deadlines": ended.get("open", 0),
        "header_timeout_s": header_timeout,
        "body_timeout_s": body_timeout,
        "server_cpu_ms_per_s_idle": round(cpu_idle, 1),
        "server_cpu_ms_per_s_hostile": round(cpu_hostile, 1),
        "rss_mb_idle": round(rss_idle, 1),
        "rss_mb_hostile": round(rss_during, 1),
        "seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    """Start the two servers, run both parts, print a table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="K = 50, 10 samples, 6 s header and body deadlines, 10 s write deadline",
    )
    parser.add_argument(
        "-k", type=int, default=None, help=f"hostile connections of each kind ({K})"
    )
    parser.add_argument(
        "--never-read-keys",
        type=int,
        default=1,
        help="keys of the tenant parking never-read streams (default 1, the issue's attack)",
    )
    args = parser.parse_args()
    k = args.k or (50 if args.quick else K)
    samples = 10 if args.quick else SAMPLES
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny(Path(tmp) / "tiny")
        flags = ["--header-timeout", "6", "--body-timeout", "6"] if args.quick else []
        server = LiveServer(Path(tmp) / "data", model, flags)
        parked = LiveServer(
            Path(tmp) / "never-read", model, never_read.server_flags(10 if args.quick else None)
        )
        try:
            for s in (server.spawn(), parked.spawn()):
                s.wait_healthy()
            key = server.create_tenant("bystander")["api_key"]
            figures = run(server, key, k=k, samples=samples)
            server.stop()  # not to share the CPU with the next part
            key = parked.create_tenant("bystander")["api_key"]
            parked_figures = never_read.run(parked, key, samples=samples, keys=args.never_read_keys)
        finally:
            server.stop()
            parked.stop()
    rows = [
        (
            "hostile connections",
            f"{k} slowloris + {k} slow bodies, open in {figures['open_seconds']} s",
        ),
        (
            "bystander /health p50",
            f"{figures['bystander_health_p50_ms_idle']} ms idle, "
            f"{figures['bystander_health_p50_ms_hostile']} ms hostile "
            f"(x{figures['bystander_health_ratio']})",
        ),
        (
            "bystander chat p50",
            f"{figures['bystander_chat_p50_ms_idle']} ms idle, "
            f"{figures['bystander_chat_p50_ms_hostile']} ms hostile "
            f"(x{figures['bystander_chat_ratio']})",
        ),
        ("hostile tenant's own chat meanwhile", str(figures["hostile_tenant_chat_status_during"])),
        ("hostile connections ended", json.dumps(figures["hostile_ended"])),
        ("held after the deadlines", str(figures["hostile_held_after_deadlines"])),
        (
            "server CPU, no bystander traffic",
            f"{figures['server_cpu_ms_per_s_idle']} ms/s idle, "
            f"{figures['server_cpu_ms_per_s_hostile']} ms/s holding the hostile connections",
        ),
        ("server RSS", f"{figures['rss_mb_idle']} -> {figures['rss_mb_hostile']} MiB"),
    ]
    rows += never_read.rows(parked_figures)
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(json.dumps({**figures, **parked_figures}))


if __name__ == "__main__":
    main()
