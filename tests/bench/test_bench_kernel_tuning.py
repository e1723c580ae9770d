"""``bench.kernel_tuning``: refused without a GPU, and its sweeps' code path on tiny shapes under
the Triton interpreter (tests/conftest.py sets it on CPU), with a wall-clock timer in place of
``do_bench`` and eager calls in place of CUDA graph replays. No timing is asserted: what is
checked is that every choice is run, checked against the unsplit result, and reported."""

import itertools
import subprocess
import sys
import time

import pytest
import torch

import bench.kernel_tuning as kt
from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow

TINY_ATTN = {"heads": 4, "kv_heads": 2, "head_dim": 32, "block_size": 16}
TINY_LORA = {"tokens": 16, "hidden": 64, "out": 64, "rank": 16}


def wall(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.fixture
def tiny(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU test: on a GPU the bench itself runs (bench/gpu_session.sh)")
    monkeypatch.setattr(kt, "ATTN", TINY_ATTN)
    monkeypatch.setattr(kt, "LORA", TINY_LORA)
    monkeypatch.setattr(kt, "DECODE_SHAPES", [(2, 192)])
    monkeypatch.setattr(kt, "SPLITS", [1, 2, 4])
    monkeypatch.setattr(kt, "LORA_CASES", [(16, 2)])
    monkeypatch.setattr(kt, "SPLIT_KS", [1, 2])
    monkeypatch.setattr(kt, "PREFILL_SHAPE", (1, 32))
    monkeypatch.setattr(kt, "LAUNCH_DECODE_SHAPES", [(2, 64)])
    monkeypatch.setattr(kt, "LAUNCH_OPTIONS", kt.LAUNCH_OPTIONS[:2])
    monkeypatch.setattr(kt, "graph_time", lambda fn, time_fn: time_fn(fn))
    return torch.device("cpu")


def test_refused_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = subprocess.run(
        [sys.executable, "-m", "bench.kernel_tuning"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "needs a CUDA GPU" in done.stderr


def test_quick_on_cpu_smokes_every_sweep(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: --quick measures there")
    result = run_bench("kernel_tuning", "--quick", data_dir=tmp_path)
    assert result["device"] == "cpu (interpreter smoke)"
    assert [(r["batch"], r["context"], r["picked"]) for r in result["decode"]] == [(2, 192, 1)]
    assert [(r["tokens"], r["adapters"]) for r in result["lora"]] == [(16, 2)]
    kinds = [r["kind"] for r in result["launch"]]
    assert kinds == ["prefill"] * 2 + ["decode"] * 9
    assert all("error" not in r for r in result["launch"])


def test_decode_sweep_runs_every_split_and_reports_the_pick(tiny):
    (row,) = kt.tune_decode(tiny, wall, copy_bps=1e9)
    # 192 positions are 3 tiles of 64: splits 1 and 2 run, 4 (more splits than tiles) does not.
    assert {k for k in row if k.startswith("split_")} == {"split_1", "split_2"}
    assert row["picked"] == 1  # off the GPU the heuristic never splits
    assert row["best"] in (1, 2) and row["picked_fraction"] == row["split_1"]
    assert row["picked_graph_fraction"] > 0


def test_lora_sweep_runs_every_split_k(tiny):
    (row,) = kt.tune_lora(tiny, wall)
    assert row["picked"] == 1 and row["best"] in (1, 2)
    assert row["split_k_1_us"] > 0 and row["split_k_2_us"] > 0
    assert row["picked_vs_base"] == row["split_k_1_us"] / row["base_us"]


def test_launch_sweep_restores_the_defaults(tiny, monkeypatch):
    from loraplex.kernels import triton_attention as ta

    before = (ta.TILE_N, ta.PREFILL_BLOCK_M, dict(ta.DECODE_LAUNCH), dict(ta.PREFILL_LAUNCH))
    product = itertools.product
    monkeypatch.setattr(itertools, "product", lambda *a: list(product(*a))[:2])
    rows = kt.tune_launch(tiny, wall, copy_bps=1e9)
    assert [r["kind"] for r in rows] == ["prefill", "prefill", "decode", "decode"]
    assert all("error" not in r for r in rows)
    assert all(r["vs_sdpa"] > 0 for r in rows if r["kind"] == "prefill")
    after = (ta.TILE_N, ta.PREFILL_BLOCK_M, dict(ta.DECODE_LAUNCH), dict(ta.PREFILL_LAUNCH))
    assert after == before
