"""``bench.cpu_threads --quick`` runs every configuration, each bound as it says."""

import os

import pytest

from tests.bench.runner import run_bench

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity calls"),
]


def test_bench_cpu_threads_quick(tmp_path):
    result = run_bench("cpu_threads", "--quick", data_dir=tmp_path, timeout=300)
    assert result["preset"] == "tiny" and result["rounds"] == 1
    configs = result["configurations"]
    cpus = result["cpus"]
    assert configs["nobind x1"]["affinity"] == cpus and not configs["nobind x1"]["pinned"]
    bound = next(v for k, v in configs.items() if k.startswith("bind ") and k.endswith(" x1"))
    assert len(bound["affinity"]) == 1 and bound["pinned"] and bound["threads"] == 1
    assert all(v["median_tokens_per_s"] > 0 for v in configs.values())
