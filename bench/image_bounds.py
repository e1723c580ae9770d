"""Image bounds: what CLIP's image processor costs per image shape, and what the bounds refuse.

Run from the repository root::

    python -m bench.image_bounds            # also the issue's 32768x1 strip, unbounded, at S = 64
    python -m bench.image_bounds --quick    # three accepted shapes at S = 336, under a minute

CLIP-style processors (LLaVA's) resize the shorter side to their input size S keeping the aspect
ratio, then crop the centre S x S, so the work is about ``ratio * S**2`` whatever the image's own
size. For each shape the table shows what ``check_image_header`` says (from a 70-byte crafted
PNG header: nothing is decoded) and, measured in a fresh process so peak memory is the image's
own, the time and peak-memory growth of transformers' ``CLIPImageProcessorPil`` at S = 64 (the
built-in tiny model, ``model init-tiny``) and S = 336 (LLaVA-1.5's settings) on random pixels.
Refused shapes are run through the processor directly, bypassing the bounds, to show what the
bound saves; at S = 336 the 32768x1 strip needs more than this machine's memory and is not run.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import struct
import subprocess
import sys
import time
import zlib

from loraplex.hashing.errors import InvalidImageError
from loraplex.hashing.image_decode import DEFAULT_MAX_ASPECT_RATIO, check_image_header

# (width, height, run through the processor at S = 64, at S = 336)
SHAPES = (
    (32768, 1, True, False),  # the issue's strip: refused
    (21, 1, True, True),  # just over the limit: refused
    (20, 1, True, True),  # the limit, upscaled
    (400, 20, True, True),
    (2000, 100, True, True),
    (6720, 336, True, True),  # the limit at S = 336 without upscaling
    (1000, 1000, True, True),
    (4000, 3000, True, True),  # a 12 MP photo
)
QUICK = {"20x1", "6720x336", "1000x1000"}  # at S = 336 only: each case is a fresh process


def _png_header(width: int, height: int) -> bytes:
    """A PNG signature and IHDR claiming ``width x height``, a tiny IDAT and IEND (~70 bytes)."""

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    idat = chunk(b"IDAT", zlib.compress(b"\0" * 16))
    return b"\x89PNG\r\n\x1a\n" + ihdr + idat + chunk(b"IEND", b"")


def _verdict(width: int, height: int) -> tuple[str, float]:
    data = _png_header(width, height)
    t0 = time.perf_counter()
    try:
        check_image_header(data)
        verdict = "accepted"
    except InvalidImageError as exc:
        verdict = "refused: " + ("aspect" if "aspect" in str(exc) else str(exc)[:20])
    return verdict, (time.perf_counter() - t0) * 1e6


def _case(side: int, width: int, height: int) -> None:
    """In a fresh process: one image through the processor; prints ms and peak MB growth."""
    import numpy as np
    from PIL import Image
    from transformers import CLIPImageProcessorPil

    proc = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    out = proc(images=[image], return_tensors="pt")["pixel_values"]
    ms = (time.perf_counter() - t0) * 1e3
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert tuple(out.shape) == (1, 3, side, side)
    print(json.dumps({"ms": ms, "peak_mb": peak}))


def _measure(side: int, width: int, height: int) -> dict | None:
    cmd = [sys.executable, "-m", "bench.image_bounds", "--case", str(side), str(width), str(height)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three shapes at S = 336")
    parser.add_argument("--case", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        _case(*args.case)
        return
    t_start = time.perf_counter()
    header = (
        f"{'shape':>11} {'ratio':>7} {'bounds':>16} {'check us':>8} {'S=64 ms':>8} "
        f"{'S=64 MB':>8} {'S=336 ms':>9} {'S=336 MB':>9}"
    )
    print(f"max aspect ratio {DEFAULT_MAX_ASPECT_RATIO:g}:1\n\n{header}\n{'-' * len(header)}")
    rows = {}
    for width, height, at64, at336 in SHAPES:
        verdict, check_us = _verdict(width, height)
        if args.quick:
            at64, at336 = False, at336 and f"{width}x{height}" in QUICK
        small = _measure(64, width, height) if at64 else None
        large = _measure(336, width, height) if at336 else None
        rows[f"{width}x{height}"] = (verdict, small, large)

        def cell(m, key, fmt):
            return format(m[key], fmt) if m else "-"

        shape, ratio = f"{width}x{height}", max(width, height) / min(width, height)
        print(
            f"{shape:>11} {ratio:7.6g} "
            f"{verdict:>16} {check_us:8.1f} {cell(small, 'ms', '8.0f'):>8} "
            f"{cell(small, 'peak_mb', '8.0f'):>8} {cell(large, 'ms', '9.0f'):>9} "
            f"{cell(large, 'peak_mb', '9.0f'):>9}"
        )
    accepted = [r for r in rows.values() if r[0] == "accepted"]
    strip = rows["32768x1"]
    result = {
        "max_aspect_ratio": DEFAULT_MAX_ASPECT_RATIO,
        "issue_strip_refused": strip[0] != "accepted",
        "issue_strip_unbounded_s64_ms": round(strip[1]["ms"]) if strip[1] else None,
        "issue_strip_unbounded_s64_peak_mb": round(strip[1]["peak_mb"]) if strip[1] else None,
        "worst_accepted_s336_ms": round(max(r[2]["ms"] for r in accepted if r[2])),
        "worst_accepted_s336_peak_mb": round(max(r[2]["peak_mb"] for r in accepted if r[2])),
        "quick": args.quick,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
