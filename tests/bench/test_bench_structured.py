"""``bench.structured --quick`` runs: both batches produce the same tokens, every constrained
output is a valid prefix of its schema (the bench asserts it), compile times are reported."""

import pytest

from bench.structured import valid_prefix
from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow


def test_valid_prefix_is_strict():
    assert valid_prefix('["alpha","be') and valid_prefix("[") and valid_prefix('["gamma"]')
    assert not valid_prefix('["alphx",') and not valid_prefix("x") and not valid_prefix("[1,")


def test_bench_structured_quick(tmp_path):
    result = run_bench("structured", "--quick", data_dir=tmp_path)
    assert result["half_constrained"]["constrained_rows"] == 4
    assert result["half_constrained"]["tokens"] == result["unconstrained"]["tokens"] == 8 * 16
    assert result["compile"]["cold_ms"] > result["compile"]["cached_ms"] > 0
