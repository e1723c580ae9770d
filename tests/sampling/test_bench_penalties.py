"""``bench.penalties --quick`` runs and reports both timings from the same run."""

import json
import subprocess
import sys


def test_bench_penalties_quick():
    run = subprocess.run(
        [sys.executable, "-m", "bench.penalties", "--quick", "--vocab", "4096"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["rows"] == 16 and result["vocab"] == 4096
    assert result["plain_ms"] > 0 and result["penalized_ms"] > 0
    assert abs(result["ratio"] - result["penalized_ms"] / result["plain_ms"]) < 0.05
