"""Benchmark: the gateway app's CPU per chat request, driven in-process through ASGI (no sockets).

``bench.gateway`` measures latency over loopback HTTP, which on a small shared VM moves 2x from
one minute to the next. This one measures what the app itself costs: the real app
(``build_gateway``: key auth, body parsing and validation, rate limiter, usage rows in SQLite,
metrics, OpenAI JSON and SSE) with :class:`bench.fake_engine.InstantEngine` behind it, called as
an ASGI application by a minimal in-process server (one request at a time, the body in one
message, the response collected). No uvicorn, no sockets, no HTTP parsing: those are the same
for any route and are in ``bench.gateway``'s ``/health`` floor.

Figures: CPU microseconds per request, of the event-loop thread (``time.thread_time``) and of the
whole process (``time.process_time``: adds the SQLite driver's thread), median of several rounds
after a warm-up, the start-up heap frozen as ``loraplex serve`` does. The baseline, same run:
the same fake engine's ``process`` + ``generate`` called directly.

Run: ``python -m bench.gateway_cpu [--quick]``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
from typing import Any

from bench.fake_engine import InstantEngine
from bench.gateway import MAX_TOKENS, MESSAGES, MODEL, build_fake, direct_call

ADMIN_KEY = "lpx-admin-bench-" + "0" * 32


class InProcessClient:
    """Calls an ASGI app the way an HTTP server would, one request at a time.

    Args:
        app: The ASGI application.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self._lifespan: asyncio.Task | None = None
        self._to_app: asyncio.Queue = asyncio.Queue()
        self._from_app: asyncio.Queue = asyncio.Queue()

    async def start(self) -> None:
        """Run the app's lifespan startup.

        Raises:
            RuntimeError: the app did not report ``lifespan.startup.complete``.
        """
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self._lifespan = asyncio.create_task(self.app(scope, self._to_app.get, self._from_app.put))
        await self._to_app.put({"type": "lifespan.startup"})
        message = await self._from_app.get()
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"app startup failed: {message}")

    async def stop(self) -> None:
        """Run the app's lifespan shutdown (flushes usage)."""
        await self._to_app.put({"type": "lifespan.shutdown"})
        await self._lifespan

    async def request(self, method: str, path: str, key: str, body: bytes) -> tuple[int, bytes]:
        """One request; ``(status, body)`` once the response is complete."""
        headers = [
            (b"host", b"bench"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"authorization", b"Bearer " + key.encode()),
        ]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000),
            "state": {},
        }
        complete = asyncio.Event()
        sent_body = False
        status = 0
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await complete.wait()  # as uvicorn: a disconnect once the response is complete
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    complete.set()

        await self.app(scope, receive, send)
        return status, b"".join(chunks)


def chat_body(stream: bool) -> bytes:
    """The ``bench.gateway`` request body."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode()


async def cpu_per_call(call, n: int, rounds: int) -> dict[str, float]:
    """Median over ``rounds`` of the CPU microseconds per ``await call()`` (``n`` calls each)."""
    loop_us, process_us = [], []
    for _ in range(rounds):
        thread0, process0 = time.thread_time(), time.process_time()
        for _ in range(n):
            await call()
        loop_us.append((time.thread_time() - thread0) / n * 1e6)
        process_us.append((time.process_time() - process0) / n * 1e6)
    return {
        "loop_us": statistics.median(loop_us),
        "process_us": statistics.median(process_us),
        "loop_us_range": (min(loop_us), max(loop_us)),
    }


def build(data_dir: str) -> tuple[Any, InstantEngine]:
    """The gateway app over a migrated SQLite database in ``data_dir``, and its fake engine."""
    app, _, engine = build_fake(data_dir, ADMIN_KEY)
    return app, engine


async def measure(app: Any, engine: InstantEngine, n: int, rounds: int) -> dict[str, dict]:
    """``{"direct" | "stream" | "json": figures}`` (see :func:`cpu_per_call`)."""
    client = InProcessClient(app)
    await client.start()
    try:
        status, created = await client.request(
            "POST", "/admin/tenants", ADMIN_KEY, json.dumps({"name": "bench"}).encode()
        )
        if status != 201:
            raise RuntimeError(f"creating the tenant failed: {status} {created[:200]!r}")
        key = json.loads(created)["api_key"]
        results = {}
        for variant in ("direct", "stream", "json"):
            if variant == "direct":
                call = direct_call(engine)
            else:
                call = _chat_call(client, key, chat_body(variant == "stream"))
            for _ in range(max(50, n // 10)):  # warm-up: caches, the key cache, the pool
                await call()
            gc.collect()
            gc.freeze()  # as GracefulServer.run does before serving
            results[variant] = await cpu_per_call(call, n, rounds)
        return results
    finally:
        await client.stop()


def _chat_call(client: InProcessClient, key: str, body: bytes):
    async def call() -> None:
        status, answer = await client.request("POST", "/v1/chat/completions", key, body)
        if status != 200 or not (answer.endswith(b"data: [DONE]\n\n") or b'"usage"' in answer):
            raise RuntimeError(f"bad answer {status}: {answer[:200]!r}")

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (< 60 s)")
    args = parser.parse_args()
    n, rounds = (300, 3) if args.quick else (2000, 5)
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-gateway-cpu-") as tmp:
        app, engine = build(tmp)
        results = asyncio.run(measure(app, engine, n, rounds))
    direct = results["direct"]["loop_us"]
    print(
        f"gateway app CPU per chat request, in-process ASGI, instant engine ({MAX_TOKENS} "
        f"tokens); median of {rounds} rounds of {n}. microseconds."
    )
    print(f"{'variant':<8}{'loop CPU':>10}{'process CPU':>13}{'rounds (loop)':>18}{'x direct':>10}")
    figures: dict[str, float] = {}
    for variant, r in results.items():
        low, high = r["loop_us_range"]
        print(
            f"{variant:<8}{r['loop_us']:>10.0f}{r['process_us']:>13.0f}"
            f"{f'{low:.0f}-{high:.0f}':>18}{r['loop_us'] / direct:>10.1f}"
        )
        figures[f"{variant}_loop_cpu_us"] = round(r["loop_us"], 1)
        figures[f"{variant}_process_cpu_us"] = round(r["process_us"], 1)
    figures["stream_added_loop_cpu_us"] = round(results["stream"]["loop_us"] - direct, 1)
    figures["json_added_loop_cpu_us"] = round(results["json"]["loop_us"] - direct, 1)
    print(
        "loop CPU: the event loop's thread; process CPU: every thread (adds the SQLite driver's). "
        "direct: the fake engine's process + generate without the app."
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
