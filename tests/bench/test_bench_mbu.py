"""``bench.mbu --quick`` runs as users run it; its byte counts are the formulas' by hand.

No timing is asserted (the machine is shared): the run completes, the bytes it divides by the
step time are exactly what the module docstring defines, and the figures agree with each other.
"""

import json

import pytest

from loraplex.engine.models.tiny_model import parameter_count
from tests.bench.runner import run_bench

pytestmark = pytest.mark.slow


def expected_bytes(model_dir, batch, context, steps, elem):
    """(weight bytes, mean KV bytes) of a timed decode step, from the config by hand."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    embedding = 0 if cfg["tie_word_embeddings"] else cfg["vocab_size"] * cfg["hidden_size"]
    weights = (parameter_count(model_dir) - embedding) * elem
    # After the prefill (context tokens computed) and 3 untimed decodes, timed step i attends
    # context + 3 + i + 1 positions in every sequence.
    mean_positions = context + 4 + (steps - 1) / 2
    per_token = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * elem
    return weights, round(batch * mean_positions * per_token)


def test_mbu_quick_float32_and_bfloat16(tmp_path):
    f32 = run_bench("mbu", "--quick", data_dir=tmp_path)
    bf16 = run_bench("mbu", "--quick", "--dtype", "bfloat16", data_dir=tmp_path)
    model_dir = tmp_path / "bench" / "tiny-text"
    for result, elem in ((f32, 4), (bf16, 2)):
        assert result["device"] == "cpu" and result["preset"] == "tiny"
        assert result["dtype"] == {4: "float32", 2: "bfloat16"}[elem]
        batch, context, steps = result["batch"], result["context"], result["steps"]
        assert (batch, context, steps) == (8, 64, 4)
        weights, kv = expected_bytes(model_dir, batch, context, steps, elem)
        assert result["weight_bytes_per_step"] == weights
        assert result["kv_bytes_per_step"] == kv
        assert 0 < result["mbu"] <= result["mbu_forward"]
        assert result["forward_ms"] <= result["step_ms"]
        # MBU is the achieved bandwidth over the copy bandwidth of the same run.
        assert result["achieved_gbs"] / result["copy_gbs"] == pytest.approx(
            result["mbu"], rel=0.02, abs=1e-3
        )
        assert result["peak_gib"] is None  # CPU: no CUDA allocator to ask
    assert f32["weight_bytes_per_step"] == 2 * bf16["weight_bytes_per_step"]
