"""What fsyncing a batch's progress file costs per answered line.

Each answered batch line is appended to ``DATA/files/<batch>.progress``
(``gateway.domains.batches.progress.ProgressLog``) and fsynced, so a crash cannot re-run and
re-bill it. This times :meth:`ProgressLog.append` with and without the fsync on a real record
(a chat completion of ``--tokens`` tokens of text, about the size of a batch output line), in
a directory on the filesystem under test (``--dir``, default: a temporary directory under the
current directory, i.e. the disk the data directory usually lives on).

    python -m bench.batch_progress [--lines 2000] [--dir PATH] [--quick]

Prints one JSON object last: per-line microseconds (median and p99) for each mode, and the
fsync's added cost per line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from loraplex.gateway.domains.batches.progress import ProgressLog, read_progress


def _record(tokens: int) -> dict:
    text = " ".join(f"word{i}" for i in range(tokens))
    return {
        "id": "batch_req_" + "0" * 32,
        "custom_id": "request-0001",
        "response": {
            "status_code": 200,
            "request_id": "chatcmpl-" + "0" * 32,
            "body": {
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 64, "completion_tokens": tokens},
            },
        },
        "error": None,
    }


def measure(directory: Path, lines: int, fsync: bool, record: dict) -> dict:
    """Append ``lines`` records to a fresh progress file; per-append times in microseconds."""
    path = directory / f"bench-{'fsync' if fsync else 'flush'}.progress"
    path.unlink(missing_ok=True)
    log = ProgressLog(path, fsync=fsync)
    times = []
    try:
        for index in range(lines):
            start = time.perf_counter()
            log.append(index, True, record)
            times.append((time.perf_counter() - start) * 1e6)
    finally:
        log.close()
    assert len(read_progress(path)) == lines
    path.unlink()
    times.sort()
    return {
        "median_us": round(statistics.median(times), 1),
        "p99_us": round(times[int(0.99 * (len(times) - 1))], 1),
        "lines_per_s": round(lines / (sum(times) / 1e6), 1),
    }


def main(argv: list[str] | None = None) -> dict:
    """Run the measurement; returns (and prints last) the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="200 lines")
    args = parser.parse_args(argv)
    lines = 200 if args.quick else args.lines
    record = _record(args.tokens)
    with tempfile.TemporaryDirectory(dir=args.dir or Path.cwd(), prefix=".bench-progress-") as d:
        flushed = measure(Path(d), lines, False, record)
        synced = measure(Path(d), lines, True, record)
    result = {
        "lines": lines,
        "record_bytes": len(json.dumps(record)),
        "flush": flushed,
        "fsync": synced,
        "fsync_added_us_per_line": round(synced["median_us"] - flushed["median_us"], 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
