"""A running batch's answers so far: one JSON line per answered request, in the data directory.

``DATA/files/<batch id>.progress`` holds, for each request answered, ``{"index", "ok",
"record"}``: its position in the input, whether it succeeded (HTTP 200), and its line of the
output or error file (OpenAI's batch output format). It is appended (and flushed) as each
request finishes, so a gateway restarted mid-batch reads it back and runs only the requests
not in it; at finalization it becomes the output and error files, in input order.
"""

from __future__ import annotations

import contextlib
import json
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

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle = open(path, "ab")  # noqa: SIM115 - closed by close()
        if self._handle.tell() and not _ends_with_newline(path):
            self._handle.write(b"\n")  # a torn line from a crash: end it, it is ignored

    def append(self, index: int, ok: bool, record: dict[str, Any]) -> None:
        """Record one answer and flush it to the OS."""
        line = json.dumps({"index": index, "ok": ok, "record": record}, separators=(",", ":"))
        self._handle.write(line.encode() + b"\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file."""
        self._handle.close()


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as handle:
        handle.seek(-1, 2)
        return handle.read(1) == b"\n"
