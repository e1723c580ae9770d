"""``bench.serving_latency --quick`` runs end to end: a real ``loraplex serve`` (engine core in its
own process) and a direct engine client, the same streams through both, figures for both."""

import pytest

from bench.serving_latency import bucket_quantile, percentile, summary
from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow


def test_percentile_and_summary():
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0, 2.0], 0.99) == 2.0
    s = summary([0.1, 0.2], [0.01, 0.03, 0.02])
    assert s["streams"] == 2 and s["gaps"] == 3 and abs(s["itl_p50_ms"] - 20.0) < 1e-9


def test_bucket_quantile():
    before = {0.1: 10.0, 0.2: 10.0, float("inf"): 10.0}
    after = {0.1: 60.0, 0.2: 109.0, float("inf"): 110.0}
    assert bucket_quantile(before, after, 0.5) == 100.0  # 50 of 100 new ones at <= 0.1 s
    assert bucket_quantile(before, after, 0.99) == 200.0
    assert bucket_quantile(before, after, 1.0) == float("inf")


def test_bench_serving_latency_quick(tmp_path):
    result = run_bench("serving_latency", "--quick", data_dir=tmp_path)
    for way in ("gateway", "direct"):
        best = result["best"][way]
        assert best["streams"] == 8 and best["gaps"] > 0 and best["ttft_p50_ms"] > 0
    # At most 7 gaps per stream of 8 tokens (fewer when a chunk carries several tokens).
    assert result["best"]["gateway"]["gaps"] <= 8 * 7 and result["best"]["direct"]["gaps"] <= 8 * 7
    assert result["itl_p99_ratio"] > 0
    # The gateway's own histogram saw the round's tokens (finite bucket bounds).
    gateway = result["best"]["gateway"]
    assert 0 < gateway["server_itl_p50_le_ms"] <= gateway["server_itl_p99_le_ms"] < float("inf")
