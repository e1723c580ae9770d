"""``bench.ratelimit --quick`` runs both limiters in one run, refuses nothing, and its two shared
limiters see one concurrency count."""

import shutil

import pytest

from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow


@pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="no redis-server (.ci/run installs it)"
)
def test_bench_ratelimit_quick():
    result = run_bench("ratelimit", "--quick", "--keys", "8", timeout=300)
    assert result["requests"] == 2000 and result["rounds"] == 3
    assert result["refused"] == {"in-process": 0, "redis": 0}
    assert result["fallback_admissions"] == 0  # every admission went through Redis
    assert result["shared_in_flight_seen"] == 2
    ratio = result["us_per_request_redis"] / result["us_per_request_in_process"]
    assert abs(result["ratio_redis_over_in_process"] - ratio) < 0.1 * ratio + 0.1
