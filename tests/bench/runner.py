"""Run a benchmark as users do (``python -m bench.NAME ...``) and read its last JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_bench(name: str, *args: str, data_dir: Path | None = None, timeout: int = 600) -> dict:
    """``python -m bench.<name> <args>`` in a subprocess; its figures (the last stdout line).

    Args:
        name: The module under ``bench``.
        args: Its arguments (``--quick``, ...).
        data_dir: ``LORAPLEX_DATA_DIR`` for the run (where it writes its models), if any.
        timeout: Seconds before the run is killed.

    Raises:
        AssertionError: it exited non-zero (with the tail of its stderr).
    """
    env = dict(os.environ)
    if data_dir is not None:
        env["LORAPLEX_DATA_DIR"] = str(data_dir)
    run = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
