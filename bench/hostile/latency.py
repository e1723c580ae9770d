"""What a hostile tenant's load does to a bystander tenant's latency (against idle, same run).

Two figures:

- ``bystander_latency_ratio``: the median latency of a bystander's small chat (non-streamed,
  ``max_tokens`` 8) while another tenant keeps sending the most expensive requests the API
  accepts (prompts as long as the model takes, eight large photos each, ``n`` 8 with long
  outputs), over the same bystander's median with the server idle.
- ``fair_share_ttft_ratio``: the bystander's median time to first token (streamed) while
  another tenant holds ``streams`` concurrent streams (1,000 in the full run), over its idle
  median.

The clients are raw asyncio streams speaking HTTP/1.1 (one connection per request, the SSE
body read as it comes), so a thousand open streams cost the client little CPU on the two cores
it shares with the server.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import statistics
import time
from typing import Any

from PIL import Image

MODEL = "tiny-llava"


async def request(
    host: str, port: int, key: str, body: dict[str, Any], *, on_first: Any = None
) -> tuple[int, float, float | None]:
    """POST a chat; ``(status, seconds to the last byte, seconds to the first content)``.

    For a stream, "first content" is the first ``data:`` event carrying text; for JSON it is
    None. The whole response is read (a stream through ``[DONE]``).
    """
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 24)
    first: float | None = None
    try:
        writer.write(head + payload)
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        while chunk := await reader.read(65536):
            if first is None and b'"content":"' in chunk and b'"content":""' not in chunk:
                first = time.perf_counter() - t0
                if on_first is not None:
                    on_first()
    finally:
        writer.close()
    return status, time.perf_counter() - t0, first


def _photo_url(side: int) -> str:
    from skimage import data

    buf = io.BytesIO()
    Image.fromarray(data.astronaut()).resize((side, side)).save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def expensive_bodies(prompt_text: str, max_images: int) -> list[dict[str, Any]]:
    """The most expensive requests the API accepts, as the hostile tenant sends them."""
    photo = _photo_url(2048)
    parts = [{"type": "image_url", "image_url": {"url": photo}}] * max_images
    return [
        {"model": MODEL, "messages": [{"role": "user", "content": prompt_text}], "max_tokens": 8},
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}],
            "max_tokens": 8,
        },
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "tell a long story"}],
            "max_tokens": 256,
            "n": 8,
        },
    ]


SMALL = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


async def _measure(host: str, port: int, key: str, count: int, stream: bool) -> list[float]:
    out = []
    for _ in range(count):
        body = dict(SMALL, stream=True) if stream else SMALL
        status, total, first = await request(host, port, key, body)
        if status == 200:
            out.append(first if stream and first is not None else total)
        await asyncio.sleep(0.05)
    return out


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "p50_ms": float("nan"), "p90_ms": float("nan")}
    ordered = sorted(values)
    return {
        "n": len(values),
        "p50_ms": statistics.median(values) * 1000,
        "p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1000,
    }


async def bystander_under_expensive_load(
    host: str,
    port: int,
    bystander: str,
    hostile: str,
    bodies: list[dict],
    *,
    samples: int,
    workers: int,
    warmup: float = 2.0,
) -> dict[str, Any]:
    """Bystander latency idle, then with ``workers`` hostile clients looping ``bodies``."""
    idle = await _measure(host, port, bystander, samples, stream=False)
    stop = asyncio.Event()
    statuses: dict[int, int] = {}

    async def hostile_worker(i: int) -> None:
        k = i
        while not stop.is_set():
            status, _, _ = await request(host, port, hostile, bodies[k % len(bodies)])
            statuses[status] = statuses.get(status, 0) + 1
            k += 1

    tasks = [asyncio.create_task(hostile_worker(i)) for i in range(workers)]
    await asyncio.sleep(warmup)  # let the load build up
    loaded = await _measure(host, port, bystander, samples, stream=False)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    a, b = _summary(idle), _summary(loaded)
    return {
        "idle": a,
        "loaded": b,
        "hostile_statuses": statuses,
        "bystander_latency_ratio": b["p50_ms"] / a["p50_ms"],
    }


async def ttft_under_many_streams(
    host: str, port: int, bystander: str, hostile: str, *, streams: int, samples: int
) -> dict[str, Any]:
    """Bystander TTFT idle, then while ``hostile`` holds ``streams`` open streams."""
    idle = await _measure(host, port, bystander, samples, stream=True)
    started = 0
    all_started = asyncio.Event()

    def one_started() -> None:
        nonlocal started
        started += 1
        if started >= streams:
            all_started.set()

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count to a thousand"}],
        "max_tokens": 1024,
        "stream": True,
    }
    flood = [
        asyncio.create_task(request(host, port, hostile, body, on_first=one_started))
        for _ in range(streams)
    ]
    try:
        await asyncio.wait_for(all_started.wait(), timeout=5.0)
    except TimeoutError:
        pass  # most are in flight; the engine runs max_num_seqs of them at a time anyway
    loaded = await _measure(host, port, bystander, samples, stream=True)
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    a, b = _summary(idle), _summary(loaded)
    return {
        "idle": a,
        "loaded": b,
        "hostile_streams_started": started,
        "fair_share_ttft_ratio": b["p50_ms"] / a["p50_ms"],
    }
