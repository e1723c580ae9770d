"""Peak memory of a live server while three hostile adapter uploads arrive at once.

Run from the repository root: ``python -m bench.hostile.uploads`` (starts its own ``loraplex
serve`` on the built-in tiny model in a temporary directory and prints one JSON line).

The three uploads, sent concurrently by one tenant:

- a zip bomb: ``adapter_model.safetensors`` of 1 GiB of zeros deflated to ~1 MiB;
- a tar.gz bomb: the same as a gzip-compressed tar;
- a safetensors header of 64 KiB of tiny entries (~9,000, against the 1,080 tensors a header
  may name for the tiny model; under its 604 KiB header cap, so the member count taken before
  parsing is what refuses it), sent as loose ``files`` parts.

Memory is the server process's peak resident set (``VmHWM``), reset just before the uploads
(``/proc/PID/clear_refs``, Linux >= 4.0) so the start-up peak cannot hide the figure;
``peak_rss_mb_hostile_uploads`` is that peak minus the resident set before. Issue 13's baseline,
three such ~1 MiB uploads before the caps: RSS 1.7 -> 6.6 GB, 2.7 GB kept.
"""

from __future__ import annotations

import io
import json
import struct
import tarfile
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Any

from bench.hostile.live import LiveServer, init_tiny

BOMB_BYTES = 1 << 30
CONFIG = json.dumps(
    {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
).encode()


class _Zeros(io.RawIOBase):
    """``size`` zero bytes as a readable stream (never all in memory)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


def zip_bomb(size: int = BOMB_BYTES) -> bytes:
    """A zip whose weights inflate to ``size`` zero bytes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr("adapter_config.json", CONFIG)
        with z.open("adapter_model.safetensors", "w", force_zip64=True) as out:
            chunk = bytes(1 << 20)
            for _ in range(size >> 20):
                out.write(chunk)
    return buf.getvalue()


def tar_gz_bomb(size: int = BOMB_BYTES) -> bytes:
    """A tar.gz whose weights member is ``size`` zero bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=9) as t:
        info = tarfile.TarInfo("adapter_config.json")
        info.size = len(CONFIG)
        t.addfile(info, io.BytesIO(CONFIG))
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = size
        t.addfile(info, io.BufferedReader(_Zeros(size), 1 << 20))
    return buf.getvalue()


def many_entry_header(size: int) -> bytes:
    """A safetensors file whose header is ``{"0":0,"1":0,...}`` filling about ``size`` bytes."""
    entries, total, i = [], 2, 0
    while total < size - 64:
        item = b'"%d":0' % i
        entries.append(item)
        total += len(item) + 1
        i += 1
    header = b"{" + b",".join(entries) + b"}"
    return struct.pack("<Q", len(header)) + header


def _status(path: Path) -> dict[str, int]:
    fields = {}
    for line in path.read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def run(server: LiveServer, key: str, bomb_bytes: int = BOMB_BYTES) -> dict[str, Any]:
    """Send the three uploads at once; report the server's peak RSS growth in MiB.

    Args:
        server: A running server.
        key: A tenant key.
        bomb_bytes: What each bomb inflates to (1 GiB; compressing it takes seconds here).
    """
    assert server.proc is not None
    pid = server.proc.pid
    uploads = {
        "zip": [("archive", ("a.zip", zip_bomb(bomb_bytes), "application/zip"))],
        "tar.gz": [("archive", ("a.tar.gz", tar_gz_bomb(bomb_bytes), "application/gzip"))],
        "header": [
            ("files", ("adapter_config.json", CONFIG, "application/json")),
            ("files", ("adapter_model.safetensors", many_entry_header(64 * 1024))),
        ],
    }
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    before = _status(Path(f"/proc/{pid}/status"))
    results: dict[str, Any] = {}

    def send(name: str) -> None:
        with server.client(key, timeout=300) as c:
            r = c.post("/v1/adapters", data={"name": f"hostile-{name}"}, files=uploads[name])
        results[name] = [r.status_code, r.json()["error"]["message"][:90] if r.is_error else ""]

    threads = [threading.Thread(target=send, args=(name,)) for name in uploads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = _status(Path(f"/proc/{pid}/status"))
    base = before["VmRSS"] if reset else before["VmHWM"]
    return {
        "peak_rss_mb_hostile_uploads": round((after["VmHWM"] - base) / 1024, 1),
        "rss_before_mb": round(before["VmRSS"] / 1024, 1),
        "rss_after_mb": round(after["VmRSS"] / 1024, 1),
        "hwm_reset": reset,
        "upload_bytes": {name: sum(len(p[1][1]) for p in parts) for name, parts in uploads.items()},
        "responses": results,
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny(Path(tmp) / "model")
        with LiveServer(Path(tmp) / "data", model, args=["--max-concurrent-requests", "64"]) as s:
            tenant = s.create_tenant("hostile")
            print(json.dumps(run(s, tenant["api_key"])))
