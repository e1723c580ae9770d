"""``bench.device`` and ``bench.presets``: the options every end-to-end bench shares.

``--device cuda`` without a GPU must stop with the reason, never measure the CPU instead; the
baselines' model is in the asked dtype; the byte counts of the GPU preset are the arithmetic of
its shape.
"""

import subprocess
import sys

import pytest
import torch

from bench.device import Target
from bench.presets import kv_bytes_per_token, weight_bytes_read
from loraplex.engine.models.tiny_model import TEXT_PRESETS, init_tiny


@pytest.mark.slow  # a subprocess each (about a second): the fast tier stays under two minutes
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("bench", ["throughput", "multi_lora", "speculative", "mbu"])
def test_device_cuda_without_a_gpu_is_refused(bench):
    run = subprocess.run(
        [sys.executable, "-m", f"bench.{bench}", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--device cuda: torch" in run.stderr and "sees no CUDA device" in run.stderr
    assert run.stdout == ""


def test_baseline_model_takes_the_targets_dtype(tmp_path):
    path = init_tiny(tmp_path / "m", text_only=True)
    target = Target(torch.device("cpu"), "bfloat16")
    assert target.engine() == {"device": "cpu", "dtype": "bfloat16", "attention_backend": "torch"}
    model = target.hf_model(path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training
    assert target.peak_gib() is None


def test_llama_1b_preset_bytes_by_hand():
    cfg = {"vocab_size": 32000, **TEXT_PRESETS["llama-1b"]}
    hidden, inter, layers = 2048, 8192, 16
    q, kv = 32 * 64, 8 * 64
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter + 2 * hidden
    params = cfg["vocab_size"] * hidden + layers * per_layer + hidden  # tied: no lm_head
    assert 1.0e9 < params < 1.1e9
    assert weight_bytes_read(cfg, 2, params) == 2 * params  # the tied head reads it all
    untied = {**cfg, "tie_word_embeddings": False}
    with_head = params + cfg["vocab_size"] * hidden
    assert weight_bytes_read(untied, 2, with_head) == 2 * params  # the input rows: not counted
    assert kv_bytes_per_token(cfg, 2) == 16 * 8 * 64 * 2 * 2
