"""``bench.speculative --quick`` runs: every method's outputs equal plain decoding's (the bench
asserts it) and the acceptance figures are consistent."""

import pytest

from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow


def test_bench_speculative_quick(tmp_path):
    result = run_bench("speculative", "--quick", data_dir=tmp_path)
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
