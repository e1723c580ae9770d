"""``bench.penalties --quick`` runs and reports both timings from the same run."""

import pytest

from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow


def test_bench_penalties_quick():
    result = run_bench("penalties", "--quick", "--vocab", "4096", timeout=300)
    assert result["rows"] == 16 and result["vocab"] == 4096
    assert result["plain_ms"] > 0 and result["penalized_ms"] > 0
    # The reported times are rounded to 0.01 ms, the ratio is not: 1% covers the rounding.
    assert result["ratio"] == pytest.approx(result["penalized_ms"] / result["plain_ms"], rel=0.01)
