"""``bench.speculative --quick`` runs: every method's outputs equal plain decoding's (the bench
asserts it) and the acceptance figures are consistent."""

import json
import os
import subprocess
import sys


def test_bench_speculative_quick(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "bench.speculative", "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "LORAPLEX_DATA_DIR": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    rows = result["results"]
    assert set(rows) == {
        f"{w}/{m}" for w in ("repeating", "non-repeating") for m in ("plain", "ngram", "draft")
    }
    for name, row in rows.items():
        assert row["tokens"] == 4 * 24, name
        assert row["accepted"] <= row["proposed"]
        assert (row["proposed"] > 0) == (row["verifications"] > 0)
        if name.endswith("/plain"):
            assert row["proposed"] == 0 and row["ratio_to_plain"] == 1.0
    assert rows["repeating/draft"]["proposed"] > 0
