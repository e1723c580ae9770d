"""A running batch's answers so far: one JSON line per answered request, in the data directory.

``DATA/files/<batch id>.progress`` holds, for each request answered, ``{"index", "ok",
"record"}``: its position in the input, whether it succeeded (HTTP 200), and its line of the
output or error file (OpenAI's batch output format). It is appended and fsynced as each
request finishes (the file's directory too, when the file is made), so a gateway restarted
mid-batch, even after a power cut, reads it back and runs (and bills) only the requests not in
it; at finalization it becomes the output and error files, in input order. The fsync costs
about a disk flush per answered line (docs/api.md has the figure, ``python -m
bench.batch_progress``); it runs in a worker thread, off the event loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any


def progress_path(files_dir: Path, batch_id: str) -> Path:
    """The batch's progress file (``batch_id`` is ours: ``batch_`` and hex)."""
    return Path(files_dir) / f"{batch_id}.progress"


def read_progress(path: Path) -> dict[int, tuple[bool, dict[str, Any]]]:
    """``index -> (ok, record)`` of every complete line (a torn last line is ignored)."""
    done: dict[int, tuple[bool, dict[str, Any]]] = {}
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as handle:
        for raw in handle:
            if not raw.endswith(b"\n"):
                continue  # cut by a crash mid-write: that request runs again
            try:
                entry = json.loads(raw)
            except ValueError:
                continue  # the same torn line, ended by the next ProgressLog
            done[int(entry["index"])] = (bool(entry["ok"]), entry["record"])
    return done


class ProgressLog:
    """Appends answered requests to a batch's progress file (blocking writes, small).

    Args:
        path: The progress file (opened for appending; made if missing).
    """

    def __init__(self, path: Path, fsync: bool = True) -> None:
        self.path = path
        self.fsync = fsync
        self._lock = threading.Lock()  # appends come from worker threads
        made = not Path(path).exists()
        self._handle = open(path, "ab")  # noqa: SIM115 - closed by close()
        if self._handle.tell() and not _ends_with_newline(path):
            self._handle.write(b"\n")  # a torn line from a crash: end it, it is ignored
        if made and fsync:
            _fsync_dir(Path(path).parent)  # the new file's name survives a crash too

    def append(self, index: int, ok: bool, record: dict[str, Any]) -> None:
        """Record one answer: write, flush and (with ``fsync``) fsync it (blocking).

        Thread-safe: each line is written whole, one writer at a time.
        """
        line = json.dumps({"index": index, "ok": ok, "record": record}, separators=(",", ":"))
        with self._lock:
            self._handle.write(line.encode() + b"\n")
            self._handle.flush()
            if self.fsync:
                os.fsync(self._handle.fileno())

    def close(self) -> None:
        """Close the file."""
        self._handle.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as handle:
        handle.seek(-1, 2)
        return handle.read(1) == b"\n"
