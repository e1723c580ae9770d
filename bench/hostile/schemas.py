"""Schema attacks against a live server: engine deaths and a bystander's decode rate (issue 27).

While ``workers`` hostile clients keep sending structured-output requests built to crash or
freeze the engine core, a bystander tenant streams greedy completions of a fixed length
(``ignore_eos``); its decode rate (tokens per second after the first token) and its longest gap
between two tokens are measured idle, then under the attack, in the same run. The attacks:

- ``chain``: the 1,050-link ``$defs`` chain that made llguidance overflow its stack (SIGSEGV in
  the core) before issue 27; refused by the structural bounds now;
- ``wide``: a different schema of 2,200 optional properties each time (about 1 s of compile on
  the core's thread, twice per request, before); refused by the bounds now;
- ``heavy``: a different schema each time, as costly as the bounds allow (five objects of 400
  optional properties): vetted in the grammar sandbox and compiled off the step, then served;
- ``never``: a schema that allows no token, different each time (the sandbox refuses it);
- ``regex``: ``a{1000000}`` (the bounds refuse it).

Figures: ``schema_engine_deaths`` (engine-core deaths logged by the server during the run:
target 0), ``schema_bystander_decode_ratio`` (median decode rate under attack over idle:
target >= 0.5), ``schema_bystander_max_gap_ratio`` and the hostile statuses per attack
(``schema_status_500_count``: target 0).

Run alone: ``python -m bench.hostile.schemas [--quick]`` (its own ``loraplex serve``), or as a
part of ``python -m bench.hostile``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

MODEL = "tiny-llava"
ATTACKS = ("chain", "wide", "heavy", "never", "regex")
CONTROL = "plain"  # the same clients sending small unconstrained chats: the machine merely busy


def chain(links: int) -> dict[str, Any]:
    """The issue's ``$defs`` chain: each link ``anyOf`` a ``$ref`` to the next and an int."""
    defs = {}
    for i in range(links):
        nxt = {"$ref": f"#/$defs/d{i + 1}"} if i + 1 < links else {"type": "integer"}
        defs[f"d{i}"] = {"anyOf": [nxt, {"type": "integer"}]}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def attack_body(kind: str, n: int) -> dict[str, Any]:
    """The ``n``-th hostile request of ``kind`` (a different schema each time where it says)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": 8,
    }
    if kind == "chain":
        body["guided_json"] = chain(1050)
    elif kind == "wide":
        body["guided_json"] = {
            "type": "object",
            "properties": {f"p{n}_{i}": {"type": "integer"} for i in range(2200)},
        }
    elif kind == "heavy":
        body["guided_json"] = {
            "type": "object",
            "properties": {
                f"o{j}": {
                    "type": "object",
                    "properties": {f"q{n}_{j}_{i}": {"type": "integer"} for i in range(400)},
                }
                for j in range(5)
            },
        }
    elif kind == "never":
        body["guided_json"] = {"$ref": "#", "title": f"never {n}"}
    elif kind == "regex":
        body["guided_regex"] = "a{1000000}"
    return body  # CONTROL: no constraint


async def post(host: str, port: int, key: str, body: dict[str, Any]) -> tuple[int, list[float]]:
    """POST a chat; ``(status, arrival times of the streamed content events)``.

    The status is -1 when the connection fails (a server that died: the "before" runs).
    """
    try:
        return await _post(host, port, key, body)
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
        await asyncio.sleep(0.1)
        return -1, []


async def _post(host: str, port: int, key: str, body: dict[str, Any]) -> tuple[int, list[float]]:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 24)
    times: list[float] = []
    try:
        writer.write(head + payload)
        status = int((await reader.readline()).split()[1])
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        while line := await reader.readline():
            if line.startswith(b"data: {") and b'"content":"' in line:
                times.append(time.perf_counter())
    finally:
        writer.close()
    return status, times


async def _bystander(host: str, port: int, key: str, count: int, tokens: int) -> list[dict]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    out = []
    for _ in range(count):
        status, times = await post(host, port, key, body)
        if status == 200 and len(times) >= 2:
            gaps = [b - a for a, b in itertools.pairwise(times)]
            out.append({"rate": (len(times) - 1) / (times[-1] - times[0]), "max_gap": max(gaps)})
        await asyncio.sleep(0.05)
    return out


async def measure(
    host: str,
    port: int,
    bystander: str,
    hostile: str,
    *,
    samples: int,
    tokens: int,
    workers: int,
    warmup: float,
    attacks: tuple[str, ...] = ATTACKS,
) -> dict[str, Any]:
    """The bystander idle, then under ``workers`` hostile clients cycling ``attacks``."""
    idle = await _bystander(host, port, bystander, samples, tokens)
    stop = asyncio.Event()
    statuses: dict[str, dict[int, int]] = {kind: {} for kind in attacks}
    counter = itertools.count()

    async def attacker() -> None:
        while not stop.is_set():
            n = next(counter)
            kind = attacks[n % len(attacks)]
            status, _ = await post(host, port, hostile, attack_body(kind, n))
            statuses[kind][status] = statuses[kind].get(status, 0) + 1

    tasks = [asyncio.create_task(attacker()) for _ in range(workers)]
    await asyncio.sleep(warmup)
    loaded = await _bystander(host, port, bystander, samples, tokens)
    stop.set()
    await asyncio.gather(*tasks)
    return {"idle": idle, "loaded": loaded, "statuses": statuses}


def _median(samples: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in samples) if samples else float("nan")


def _ratio(a: float, b: float) -> float | None:
    """``a / b`` to two places; None (JSON null) when either side has no sample."""
    value = a / b
    return round(value, 2) if value == value else None


def engine_deaths(log_path: Path) -> int:
    """Engine-core deaths the server logged (``engine.client.process``'s death line)."""
    if not log_path.exists():
        return 0
    return log_path.read_text(errors="replace").count(") died with status")


def run(server: Any, bystander: str, hostile: str, *, quick: bool = False) -> dict[str, Any]:
    """The schema attacks against ``server`` (a ``LiveServer``); the figures."""
    deaths_before = engine_deaths(server.log_path)
    samples = 4 if quick else 12
    m = asyncio.run(
        measure(
            "127.0.0.1",
            server.port,
            bystander,
            hostile,
            samples=samples,
            tokens=48 if quick else 96,
            workers=4,
            warmup=1.0 if quick else 2.0,
        )
    )
    try:
        with server.client() as c:
            healthy = c.get("/health").status_code == 200
    except (OSError, httpx.HTTPError):  # the server is gone
        healthy = False
    idle_rate, loaded_rate = _median(m["idle"], "rate"), _median(m["loaded"], "rate")
    idle_gap, loaded_gap = _median(m["idle"], "max_gap"), _median(m["loaded"], "max_gap")
    statuses = m["statuses"]
    print("schema attacks (hostile statuses per attack):")
    for kind in ATTACKS:
        print(f"  {kind:<6} {dict(sorted(statuses[kind].items()))}")
    print(
        f"bystander decode, idle {idle_rate:.1f} tok/s (max gap {idle_gap * 1e3:.0f} ms), "
        f"under attack {loaded_rate:.1f} tok/s (max gap {loaded_gap * 1e3:.0f} ms)"
    )
    return {
        "schema_engine_deaths": engine_deaths(server.log_path) - deaths_before,
        "schema_engine_healthy": healthy,
        "schema_bystander_decode_ratio": _ratio(loaded_rate, idle_rate),
        "schema_bystander_max_gap_ratio": _ratio(loaded_gap, idle_gap),
        "schema_bystander_served_under_attack": f"{len(m['loaded'])} of {samples}",
        "schema_bystander_idle_tok_s": round(idle_rate, 1),
        "schema_hostile_requests": sum(sum(s.values()) for s in statuses.values()),
        "schema_status_500_count": sum(s.get(500, 0) for s in statuses.values()),
        "schema_served_heavy": statuses["heavy"].get(200, 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (< 60 s)")
    args = parser.parse_args()
    from bench.hostile.live import LiveServer, init_tiny

    work = Path(tempfile.mkdtemp(prefix="loraplex-hostile-schemas-"))
    model = init_tiny(work / "model")
    flags = ["--served-model-name", MODEL, "--tenant-share", "1"]
    with LiveServer(work / "server", model, flags) as server:
        hostile = server.create_tenant("hostile")
        bystander = server.create_tenant("bystander")
        server.set_limits(
            hostile["id"],
            requests_per_minute=1_000_000,
            tokens_per_minute=1_000_000_000,
            max_concurrent_requests=10_000,
        )
        figures = run(server, bystander["api_key"], hostile["api_key"], quick=args.quick)
    width = max(len(k) for k in figures)
    for key in sorted(figures):
        print(f"{key:<{width}}  {figures[key]}")
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
