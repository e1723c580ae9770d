"""``loraplex serve|generate --model``: Hub ids, revisions, GGUF files, and one-line failures.

The slow tests run the installed command with huggingface_hub's own environment variables
(``HF_HOME``, ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``): a pre-populated HF cache stands in for the
Hub (the machine has no network) and a loopback port nothing listens on for a Hub that cannot
be reached.
"""

import json
import os
import subprocess
import sys

import pytest

from loraplex.engine.models.tiny_model import init_tiny
from loraplex.gateway.cli import main
from tests.models.fake_hub import cache_snapshot, model_files
from tests.support import free_port

MAIN, V2 = "1" * 40, "2" * 40
REQUESTS = [
    {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0}
    for text in ("Hello there!", "Name a colour.")
]


def _loraplex():
    return [sys.executable, "-m", "loraplex.gateway.cli"]  # this interpreter's install


def _env(tmp_path, **extra):
    """The environment of a fresh machine: an empty HF home, no token, no loraplex variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LORAPLEX_", "HF_", "HUGGING_FACE_"))
    }
    env.update(HF_HOME=str(tmp_path / "hf"), LORAPLEX_CACHE_DIR=str(tmp_path / "cache"))
    env.update(extra)
    return env


def _input(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    return path


def test_a_model_that_names_nothing_is_one_line_and_exit_1(tmp_path, capsys):
    argv = ["generate", "--model", "./no/such/model", "--input", str(_input(tmp_path))]
    assert main([*argv, "--output", str(tmp_path / "out.jsonl")]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "loraplex generate: error: model './no/such/model': no such directory or .gguf file, and "
        "not a Hugging Face Hub id (org/name): pass a model directory, a .gguf file or a Hub id"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_an_unreachable_hub_is_one_line_and_exit_1(tmp_path, command):
    port = free_port()  # nothing listens there: the connection is refused
    env = _env(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{port}")
    argv = [*_loraplex(), command, "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    if command == "generate":
        argv += ["--input", str(_input(tmp_path)), "--output", str(tmp_path / "out.jsonl")]
    else:
        argv += ["--port", "0", "--data-dir", str(tmp_path / "data")]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, out.stderr
    assert errors[0].startswith(f"loraplex {command}: error: model 'HuggingFaceTB/SmolLM2-135M")
    assert f"cannot reach the Hub at http://127.0.0.1:{port}" in errors[0]
    assert "`hf download HuggingFaceTB/SmolLM2-135M-Instruct`" in errors[0]
    if command == "generate":  # nothing before it: the one line is all
        assert out.stderr.splitlines() == errors


def _generate(tmp_path, model, *flags, env):
    """Token ids of ``loraplex generate`` over REQUESTS, in a child with ``env``."""
    out_path = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}.jsonl"
    argv = [*_loraplex(), "generate", "--model", str(model), "--num-kv-blocks", "64", *flags]
    argv += ["--input", str(_input(tmp_path)), "--output", str(out_path)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return [line["outputs"][0]["token_ids"] for line in map(json.loads, out_path.open())]


def _expected(model_dir):
    """The same requests through ``LLM`` on a directory, in this process (what generate runs)."""
    from loraplex.engine.client.llm import LLM
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.sampling.params import SamplingParams

    llm = LLM(EngineConfig(model=str(model_dir), num_kv_blocks=64))
    try:
        requests = [
            llm.make_request(r["messages"], SamplingParams(temperature=0.0, max_tokens=8))
            for r in REQUESTS
        ]
        return [out.outputs[0].token_ids for out in llm.generate(requests)]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_generate_from_a_cached_hub_id_at_a_revision_offline_and_from_a_gguf_file(
    tmp_path, text_dir
):
    from tests.models.gguf_file import write_llama_gguf

    pytest.importorskip("gguf")
    other = init_tiny(tmp_path / "seed1", seed=1, text_only=True)
    hub = tmp_path / "hf" / "hub"
    cache_snapshot(hub, "acme/tiny", MAIN, model_files(text_dir))
    cache_snapshot(hub, "acme/tiny", V2, model_files(other), refs=("v2",))
    main_tokens, v2_tokens = _expected(text_dir), _expected(other)
    assert main_tokens != v2_tokens  # two different models
    env = _env(tmp_path, HF_HUB_OFFLINE="1")
    assert _generate(tmp_path, "acme/tiny", "--revision", "v2", env=env) == v2_tokens
    gguf_file = write_llama_gguf(text_dir, tmp_path / "tiny.gguf")
    assert _generate(tmp_path, gguf_file, "--dtype", "auto", env=env) == main_tokens


@pytest.mark.slow
def test_served_from_a_hub_id_the_engine_process_gets_the_directory(
    tmp_path, text_dir, monkeypatch
):
    from huggingface_hub import constants

    from loraplex.engine.config import EngineConfig
    from loraplex.engine.models.source import resolve_model_source
    from loraplex.gateway.server.build import start_engine

    hub = tmp_path / "hf" / "hub"
    snapshot = cache_snapshot(hub, "acme/tiny", MAIN, model_files(text_dir))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    resolved = resolve_model_source(EngineConfig(model="acme/tiny", num_kv_blocks=64))
    # The Hub id no longer resolves (and the child process has another environment: no such
    # cache): it starts only if it is handed the directory.
    (hub / "models--acme--tiny" / "refs" / "main").unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    client = start_engine(resolved, tmp_path / "store", in_process=False)
    try:
        assert client.core.config.model == str(snapshot)
        assert client.model_name == "acme/tiny"
        assert client.describe()["pid"] not in (None, os.getpid())
    finally:
        client.shutdown()
