"""``bench.kv_shared_tier --quick`` runs as users run it (Redis and fsspec only: Ray's start and
moto's server would add ~10 s to the suite): every record read back is the one written, every
candidate reports each figure, the tier as built is measured next to raw Redis. No timing is
asserted (the machine is shared)."""

import shutil

import pytest

from tests.bench.runner import run_bench

pytestmark = [pytest.mark.slow, pytest.mark.service]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")
def test_kv_shared_tier_quick():
    result = run_bench("kv_shared_tier", "--quick", "--no-ray", "--no-s3")
    assert result["bench"] == "kv_shared_tier" and result["quick"]
    assert result["block_nbytes"] == {"float32": 737_280, "bfloat16": 368_640}
    names = {"redis", "redis-pyparser", "fsspec-file", "fsspec-memory", "RedisTier"}
    assert set(result["results"]) == {f"{n}/{d}" for n in names for d in ("float32", "bfloat16")}
    assert result["mismatches"] == 0
    for row in result["results"].values():
        assert row["mismatches"] == 0
        for figure in ("put_us", "get_us", "get_batch_us", "contains_us"):
            assert row[figure] > 0
    loads = result["store_load_float32"]  # TieredStore.load_prefix from each tier alone
    assert set(loads) == {"host", "disk", "remote"}
    assert all(row["mismatches"] == 0 and row["us_per_block"] > 0 for row in loads.values())
    assert set(result["checksum_GBps"]) >= {"xxh3_64/block", "crc32/block", "sha256/large"}
    assert result["choice"] == "redis" and result["ray_init_s"] is None
