"""The hostile requests issues 13 and 27 found harmful, sent to a live server, and what came back.

Each attack is one HTTP request a stranger can send with a valid tenant key (or none). None may
be answered with a 500, none may stop the engine: after the whole catalog ``/health`` must
still be 200 and a plain chat must still work. The figures: ``status_500_count`` and
``engine_survived``.
"""

from __future__ import annotations

import base64
import io
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
from PIL import Image

from bench.hostile.schemas import chain

MODEL = "tiny-llava"


def png(width: int, height: int) -> str:
    """A ``data:`` URL of a black PNG of that size (a 32768 x 1 one is a few hundred bytes)."""
    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, "PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def png_header_bomb(width: int = 100_000, height: int = 100_000) -> str:
    """A PNG whose header claims ``width x height`` pixels (the file itself is tiny)."""
    import struct
    import zlib

    def chunk(tag: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(tag + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def chat(**fields: Any) -> dict[str, Any]:
    """A chat body with ``fields`` over a small default."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    body.update(fields)
    return body


def images(url: str, count: int) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}}] * count
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "what is this?"}]}]


def catalog(max_model_len: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(name, httpx request kwargs)`` of every hostile request (path defaults to chat)."""
    yield "top_k 2**63", {"json": chat(top_k=9223372036854775808)}
    yield "top_k 2**31", {"json": chat(top_k=2**31)}
    yield "seed 2**64", {"json": chat(seed=2**64)}
    yield "logprobs, no top_logprobs", {"json": chat(logprobs=True)}
    yield "top_logprobs 0", {"json": chat(logprobs=True, top_logprobs=0)}
    yield (
        "top_logprobs 0, n 3, stream",
        {"json": chat(logprobs=True, top_logprobs=0, n=3, stream=True)},
    )
    yield "temperature 1e308", {"json": chat(temperature=1e308)}
    yield "max_tokens 2**63", {"json": chat(max_tokens=2**63)}
    yield "n 2**63", {"json": chat(n=2**63)}
    yield (
        "prompt + max_tokens past the model",
        {"json": chat(messages=[{"role": "user", "content": "word " * max_model_len}])},
    )
    yield (
        "30 MiB of text",
        {"json": chat(messages=[{"role": "user", "content": "a" * (30 * 1024 * 1024)}])},
    )
    yield (
        "a message per token",
        {"json": chat(messages=[{"role": "user", "content": ""}] * (max_model_len + 5))},
    )
    yield "eight 32768x1 PNGs", {"json": chat(messages=images(png(32768, 1), 8))}
    yield "eight 1x32768 PNGs", {"json": chat(messages=images(png(1, 32768), 8))}
    yield "PNG header claiming 10^10 pixels", {"json": chat(messages=images(png_header_bomb(), 1))}
    yield "nine images", {"json": chat(messages=images(png(16, 16), 9))}
    yield "JSON nested 5000 deep", {"content": b"[" * 5000 + b"]" * 5000}
    yield "invalid UTF-8", {"content": b'{"model": "tiny-llava", "messages": "\xff"}'}
    yield "CESU-8 surrogate", {"content": b'{"model": "\xed\xa0\x80", "messages": []}'}
    yield "NUL in model", {"json": chat(model="tiny\x00llava")}
    yield "NUL in content", {"json": chat(messages=[{"role": "user", "content": "a\x00b"}])}
    yield "stop string of 1 MB", {"json": chat(stop=["x" * 1_000_000])}
    yield (
        "remote image URL",
        {"json": chat(messages=images("http://169.254.169.254/latest/meta-data", 1))},
    )
    # issue 27: token ids past int64, malformed messages, grammars that crash or never match
    completions = {"model": MODEL, "prompt": [2**64], "max_tokens": 1}
    yield "token id 2**64 in a completions prompt", {"path": "/v1/completions", "json": completions}
    yield "unknown role", {"json": chat(messages=[{"role": "wizard", "content": "hi"}])}
    yield "content null on a user message", {"json": chat(messages=[{"role": "user"}])}
    bad_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not"}}
    yield (
        "tool call arguments that are not JSON",
        {
            "json": chat(
                messages=[
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [bad_call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                ]
            )
        },
    )
    yield "1,050-link $defs chain (SIGSEGV before)", {"json": chat(guided_json=chain(1050))}
    yield 'schema {"$ref": "#"} (allows no token)', {"json": chat(guided_json={"$ref": "#"})}
    yield "guided_regex a{1000000}", {"json": chat(guided_regex="a{1000000}")}
    yield "/metrics with a tenant key", {"path": "/metrics", "method": "GET"}
    yield "admin route, tenant key", {"path": "/admin/tenants", "json": {"name": "x"}}
    yield "admin limits 2**63", {"path": "/admin/tenants/x/limits", "method": "PUT", "admin": True}


def run(base_url: str, key: str, admin_key: str, max_model_len: int) -> dict[str, Any]:
    """Send every attack once; count statuses, then check the server still serves.

    Returns:
        ``{"statuses": {name: status}, "status_500_count": int, "engine_survived": bool}``.
    """
    statuses: dict[str, int] = {}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for name, spec in catalog(max_model_len):
            spec = dict(spec)
            path = spec.pop("path", "/v1/chat/completions")
            method = spec.pop("method", "POST")
            token = admin_key if spec.pop("admin", False) else key
            if name == "admin limits 2**63":
                spec["json"] = {"requests_per_minute": 2**63}
            headers = {"Authorization": f"Bearer {token}"}
            if "content" in spec:
                headers["content-type"] = "application/json"
            try:
                r = client.request(method, path, headers=headers, **spec)
                statuses[name] = r.status_code
            except httpx.HTTPError as exc:
                statuses[name] = -1
                print(f"  {name}: {type(exc).__name__}")
        survived = client.get("/health").status_code == 200
        ok = client.post(
            "/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {key}"}
        )
        survived = survived and ok.status_code == 200
    counts = Counter(statuses.values())
    return {
        "statuses": statuses,
        "status_500_count": sum(n for s, n in counts.items() if s >= 500 and s != 503),
        "engine_survived": survived,
    }
