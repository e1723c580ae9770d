"""``loraplex model targets DIR``: what an adapter may target, from a config.json alone."""

from __future__ import annotations

import json
import re

import transformers

from loraplex.gateway.cli import main as cli_main


def test_prints_the_targets_of_a_config_without_weights(tmp_path, capsys):
    config = transformers.Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    config.save_pretrained(tmp_path)  # config.json only: no weights to read
    assert cli_main(["model", "targets", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == {
        "architecture": "Phi3ForCausalLM",
        "decoder_layers": "model.layers",
        "num_layers": 3,
        "target_modules": ["o_proj", "qkv_proj", "gate_up_proj", "down_proj"],
        "target_modules_regex": summary["target_modules_regex"],
    }
    regex = summary["target_modules_regex"]
    assert re.fullmatch(regex, "model.layers.2.self_attn.qkv_proj")
    assert re.fullmatch(regex, "model.layers.0.mlp.gate_up_proj")
    assert not re.fullmatch(regex, "model.embed_tokens")
    assert not re.fullmatch(regex, "lm_head")


def test_a_missing_directory_is_one_line(tmp_path, capsys):
    assert cli_main(["model", "targets", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model directory not found" in json.loads(err[0])["error"]
