"""``bench.scale --quick`` runs end to end: four configurations over child-process replicas,
the same workload for each, the figures the issue asks for."""

import pytest

from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow


def test_bench_scale_quick(tmp_path):
    # One request at a time: routing sees every earlier request's events (deterministic).
    args = ("--quick", "--requests", "24", "--concurrency", "1")
    result = run_bench("scale", *args, data_dir=tmp_path)
    rows = result["results"]
    assert set(rows) == {"one-big", "router", "round-robin", "least-loaded"}
    for name, row in rows.items():
        assert row["tokens"] == 24 * 16, name
        assert 0 <= row["cached"] <= row["prompt"] and row["ttft_p99_ms"] >= row["ttft_p50_ms"]
        assert sum(row["routed"].values()) == 24
    assert len(rows["round-robin"]["routed"]) == 2
    assert rows["router"]["hit_rate"] >= rows["round-robin"]["hit_rate"]
