"""``bench.console_usage --quick``: the rollups agree with the rows, every query is timed."""

import pytest

from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow


def test_bench_console_usage_quick():
    result = run_bench("console_usage", "--quick", timeout=300)
    assert result["busy_tenant_rows"] == 10_000 and result["days"] == 30
    sqlite = result["sqlite"]
    assert sqlite["rollups_exact"] is True  # the trigger's totals equal the rows' own
    assert set(sqlite["after_ms"]) == {
        "series_hour_month",
        "series_day_month",
        "csv_hour_by_model_month",
        "breakdown_month",
        "v1_usage_month",
        "admin_all_tenants_day_month",
    }
    assert all(ms > 0 for ms in sqlite["after_ms"].values())
    assert sqlite["pages_max_ms"] == max(
        sqlite["after_ms"][k] for k in ("series_hour_month", "series_day_month", "breakdown_month")
    )
    assert "postgresql" not in result  # no --pg-url
