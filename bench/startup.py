"""Start-up: ``loraplex serve`` launch to the first 200 on ``/health``, on the built-in tiny model.

Run from the repository root (the ``loraplex`` on PATH is the one measured)::

    python -m bench.startup              # 3 launches
    python -m bench.startup --runs 5 --data-dir /tmp/lpx-start

Each run launches ``loraplex serve`` on a free port with its own data directory (made, with the
tiny model and a migrated database, by a first launch that is not counted), polls ``/health``
every 50 ms, and records the wall time from launch to the first 200, the CPU seconds the server
process had used by then (user + system, all its threads, from ``/proc``: less sensitive than
wall time to other work on a shared machine), when each of its ``loraplex:`` progress lines
came, and the load average. The server is then stopped with SIGINT. The last line is one JSON
object of the figures. docs/startup.md has the results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

TIMEOUT = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def launch(data_dir: str) -> dict:
    """One launch: seconds to the first 200, CPU seconds by then, the progress lines' times."""
    exe = shutil.which("loraplex")
    cmd = [exe] if exe else [sys.executable, "-m", "loraplex.gateway.cli"]
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [*cmd, "serve", "--data-dir", data_dir, "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append((time.monotonic() - t0, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready = cpu = None
    try:
        while time.monotonic() - t0 < TIMEOUT and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        ready, cpu = time.monotonic() - t0, _cpu_seconds(proc.pid)
                        break
            except OSError:
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    if ready is None:
        raise SystemExit("serve did not answer /health:\n" + "\n".join(x for _, x in lines))
    return {
        "health_s": round(ready, 2),
        "cpu_s": round(cpu, 2),
        "load_1min": os.getloadavg()[0],
        "exit_code": proc.returncode,
        "progress": [(round(t, 2), x) for t, x in lines if x.startswith("loraplex: ")],
        "leak_lines": sum("nanobind: leaked" in x for _, x in lines),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--data-dir", default=None, help="default: a fresh temporary directory")
    args = parser.parse_args()
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="lpx-startup-")
    first = launch(data_dir)  # writes the tiny model, the keys and the database
    print(f"first launch (not counted): {first['health_s']} s", flush=True)
    runs = []
    for i in range(args.runs):
        run = launch(data_dir)
        runs.append(run)
        print(
            f"run {i}: /health 200 after {run['health_s']} s, {run['cpu_s']} CPU s, "
            f"load {run['load_1min']:.1f}, exit {run['exit_code']}, "
            f"{run['leak_lines']} nanobind leak lines",
            flush=True,
        )
        for t, line in run["progress"]:
            print(f"    {t:6.2f} s  {line}", flush=True)
    summary = {
        "runs": runs,
        "health_s_median": statistics.median(r["health_s"] for r in runs),
        "cpu_s_median": statistics.median(r["cpu_s"] for r in runs),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
