"""``bench.throughput --model-impl both`` and ``bench.backend_overhead`` run as users run them.

No timing is asserted (the machine is shared): the runs complete, both implementations made
the same tokens, and every figure is reported.
"""

import pytest

from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow


def test_throughput_both_implementations_quick(tmp_path):
    result = run_bench(
        "throughput", "--quick", "--preset", "bench", "--model-impl", "both", "--threads", "1",
        data_dir=tmp_path,
    )  # fmt: skip
    assert result["model_impl"] == "both" and result["rounds"] == 2
    assert result["token_exact"] == f"{2 * result['requests']}/{2 * result['requests']}"
    assert len(result["ratios_per_round"]) == len(result["cpu_time_ratios_per_round"]) == 2
    assert all(r > 0 for r in result["ratios_per_round"])
    assert set(result["decode_step_ms"]) == {"1"}
    assert result["torch_threads"] == 1


def test_throughput_one_implementation_quick(tmp_path):
    # The tiny preset: the bench preset's transformers run is already in the test above.
    result = run_bench(
        "throughput", "--quick", "--preset", "tiny", "--model-impl", "transformers",
        data_dir=tmp_path,
    )  # fmt: skip
    assert result["model_impl"] == "transformers" and result["tokens_per_s"] > 0


def test_throughput_tiny_bfloat16_quick(tmp_path):
    """The dtype reaches both sides: the engine and transformers' ``generate`` (bfloat16)."""
    result = run_bench(
        "throughput", "--quick", "--preset", "tiny", "--dtype", "bfloat16", data_dir=tmp_path
    )
    assert result["preset"] == "tiny" and result["dtype"] == "bfloat16"
    assert result["device"] == "cpu" and result["requests"] == 16
    assert result["tokens_per_s"] > 0 and result["transformers_tokens_per_s"] > 0
    assert set(result["transformers_tokens_per_s_by_batch"]) == {"16"}
    assert result["peak_gib"] is None


def test_backend_overhead_quick():
    result = run_bench("backend_overhead", "--quick")
    assert {"forward pass (whole step)", "decoder layer", "attention module", "MLP"} <= set(result)
    assert all(v["native_us"] > 0 and v["transformers_us"] > 0 for v in result.values())
