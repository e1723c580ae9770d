"""``bench.cuda_graphs --quick`` runs as users run it: on the CPU it says graphs are off and
reports eager decode figures only (no timing is asserted: the machine is shared)."""

import pytest

from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow


def test_bench_cuda_graphs_quick_on_cpu(tmp_path):
    result = run_bench("cuda_graphs", "--quick", data_dir=tmp_path)
    assert result["device"] == "cpu" and result["graphs"] is False
    rows = result["results"]
    assert set(rows) == {"tiny/b1/eager", "tiny/b4/eager"}
    for row in rows.values():
        assert row["steps"] == result["steps"] == 4
        assert row["step_ms"] >= row["forward_ms"] > 0
        assert 0.0 <= row["host_overhead_share"] < 1.0
        assert row["graph_replays"] == 0
