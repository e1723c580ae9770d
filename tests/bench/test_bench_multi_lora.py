"""``bench.multi_lora --quick`` runs as users run it, in bfloat16 on both sides.

No timing is asserted (the machine is shared): every configuration and the peft baseline ran,
in the asked dtype, and every figure is reported.
"""

import pytest

from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow


def test_multi_lora_quick_bfloat16(tmp_path):
    result = run_bench(
        "multi_lora", "--quick", "--passes", "1", "--adapters", "1,64", "--dtype", "bfloat16",
        data_dir=tmp_path,
    )  # fmt: skip
    assert result["dtype"] == "bfloat16" and result["device"] == "cpu"
    assert result["preset"] == "tiny" and result["passes"] == 1 and result["requests"] == 64
    assert set(result) >= {"ratio_64_vs_1", "ratio_vs_peft", "cold_load_ms"}
    assert "ratio_8_vs_1" not in result
    assert result["tokens_per_s_1"] > 0 and result["tokens_per_s_64"] > 0
    assert result["peft_tokens_per_s"] > 0 and result["cold_load_ms"] > 0


def test_multi_lora_needs_one_and_sixty_four_adapters():
    with pytest.raises(AssertionError, match="must include 1"):
        run_bench("multi_lora", "--quick", "--adapters", "8,64")
