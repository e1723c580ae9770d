"""``bench.cpu_step --quick`` runs as users run it: every mode's engine is what it says (dense,
prepacked, bfloat16; the compiled mode's engine is tests/engine/test_compiled_step.py's, left out
here to spare the suite a second compilation), float32 modes give the dense engine's tokens, and
every ratio is computed from the figures it reports. No timing is asserted (the machine is
shared)."""

import pytest

from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow  # three engines in a subprocess


def test_cpu_step_quick(tmp_path):
    result = run_bench("cpu_step", "--quick", data_dir=tmp_path)
    assert result["bench"] == "cpu_step" and result["preset"] == "tiny"
    assert set(result["engine_start_s"]) == {"dense", "packed", "compiled", "bf16"}
    assert set(result["compile_s"]) == {"compiled"} and result["compile_s"]["compiled"] > 0
    rows = result["results"]
    assert set(rows) == {
        f"{m}/{b}" for m in ("dense", "packed", "compiled", "bf16") for b in (1, 4)
    }
    for batch in (1, 4):
        dense = rows[f"dense/{batch}"]
        for mode in ("packed", "compiled"):  # float32: the same greedy tokens
            assert rows[f"{mode}/{batch}"]["same_tokens_as_dense"], (mode, batch)
        for mode in ("packed", "compiled", "bf16"):
            row = rows[f"{mode}/{batch}"]
            assert row["decode_x"] == pytest.approx(dense["decode_ms"] / row["decode_ms"])
            assert row["prefill_x"] == pytest.approx(row["prefill_tok_s"] / dense["prefill_tok_s"])


def test_unknown_mode_is_a_usage_error():
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "bench.cpu_step", "--modes", "packed,turbo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "turbo" in run.stderr
