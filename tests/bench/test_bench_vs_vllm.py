"""``bench.vs_vllm``: its skip path, its command line, and the parsing of ``vllm bench serve``.

CI has no vLLM, so the side-by-side run itself is not tested here (docs/benchmarks.md has the
command and the figures). ``data/vllm_bench_serve_0.32.0.json`` is a ``--save-result`` file
written by ``vllm bench serve`` 0.32.0 (random dataset, 4 prompts of 64 tokens, 8 out,
concurrency 1, ``--metric-percentiles 50,99``) against ``vllm serve`` of the smollm-135m preset.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import bench.vs_vllm as vs
from tests.bench.runner import run_bench

FIXTURE = Path(__file__).parent / "data" / "vllm_bench_serve_0.32.0.json"
FIXTURE_WORKLOAD = vs.Online("c1", 1, 4, 64, 8, 0, 0)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_skips_without_vllm_python(capsys):
    assert vs.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("bench.vs_vllm skipped: no --vllm-python given")
    assert last_json(out[-1]) == {"bench": "vs_vllm", "skipped": out[0].split(": ", 1)[1]}


def test_skips_when_the_python_does_not_exist(capsys, tmp_path):
    assert vs.main(["--vllm-python", str(tmp_path / "nope")]) == 0
    assert "no such file" in last_json(capsys.readouterr().out)["skipped"]


def fake_probe(monkeypatch, returncode: int, stdout: str = "", stderr: str = ""):
    def run(cmd, **kwargs):
        assert cmd[1] == "-c" and "import vllm" in cmd[2]
        return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)

    monkeypatch.setattr(vs.subprocess, "run", run)


def test_skips_when_the_python_lacks_vllm(capsys, monkeypatch):
    fake_probe(monkeypatch, 1, stderr="Traceback...\nModuleNotFoundError: No module named 'vllm'\n")
    assert vs.main(["--vllm-python", sys.executable]) == 0
    out = capsys.readouterr().out
    assert out.startswith("bench.vs_vllm skipped: ")
    assert last_json(out)["skipped"].endswith(
        "cannot import vllm: ModuleNotFoundError: No module named 'vllm'"
    )


def test_skips_without_the_metadata_shim(capsys, monkeypatch):
    info = {"prefix": "/v", "dist": None, "version": "0.32.0"}
    fake_probe(monkeypatch, 0, stdout=json.dumps(info) + "\n")
    assert vs.main(["--vllm-python", sys.executable]) == 0
    assert "no 'vllm' distribution metadata" in last_json(capsys.readouterr().out)["skipped"]


@pytest.mark.slow
def test_skip_path_as_users_run_it():
    result = run_bench("vs_vllm", "--quick", timeout=120)
    assert result["skipped"].startswith("no --vllm-python given")
    result = run_bench("vs_vllm", "--quick", "--vllm-python", sys.executable, timeout=120)
    assert "cannot import vllm" in result["skipped"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--threads", "0"],
        ["--threads", "two"],
        ["--rounds", "0"],
        ["--kv-cache-gib", "-1"],
        ["--workloads", "c1,c64"],
        ["--workloads", ","],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        vs.main(argv)
    assert exc.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_workloads_parse():
    assert vs.parse_workloads("c1, offline,c1") == ["c1", "offline"]
    args = vs.build_parser().parse_args([])
    assert args.workloads == ["c1", "c8", "c32", "prefix", "offline"]
    assert (args.threads, args.rounds, args.kv_cache_gib, args.quick) == (1, 1, 4, False)


def test_quick_without_c1_or_offline_is_refused(capsys, monkeypatch):
    env = vs.VllmEnv("py", "vllm", "0.32.0", {})
    monkeypatch.setattr(vs, "find_vllm", lambda *a: (env, ""))
    assert vs.main(["--vllm-python", "py", "--quick", "--workloads", "c8,prefix"]) == 2
    assert "--quick runs only c1 and offline" in capsys.readouterr().err


def test_workload_sizes():
    full = vs.online_workloads(False)
    assert [(w.concurrency, w.num_prompts) for w in full.values()] == [
        (1, 16),
        (8, 32),
        (32, 64),
        (8, 64),
    ]
    assert all((w.input_len, w.output_len) == (256, 64) for w in full.values())
    assert full["prefix"].prefix_len == 1024 and len({w.seed for w in full.values()}) == 4
    assert list(vs.online_workloads(True)) == ["c1"]
    assert vs.offline_workload(False) == vs.Offline(32, 100, 400, 64)


def test_parse_a_saved_vllm_bench_serve_result():
    figures = vs.parse_serve_result(json.loads(FIXTURE.read_text()), FIXTURE_WORKLOAD)
    assert figures["output_tok_s"] == pytest.approx(31.84487083249546)
    assert figures["ttft_p50_ms"] == pytest.approx(85.52805900399107)
    assert figures["ttft_p99_ms"] == pytest.approx(101.32232184194436)
    assert figures["itl_p50_ms"] == pytest.approx(21.19069099717308)
    assert figures["tpot_p50_ms"] == pytest.approx(22.658343928924296)
    assert (figures["completed"], figures["failed"], figures["output_tokens"]) == (4, 0, 32)
    assert figures["expected_output_tokens"] == 32 and figures["ok"]


def test_a_short_result_is_not_ok():
    data = json.loads(FIXTURE.read_text())
    wanted = vs.Online("c1", 1, 4, 64, 16, 0, 0)  # 16 tokens each were asked for, 8 came
    assert not vs.parse_serve_result(data, wanted)["ok"]
    data["failed"] = 1
    assert not vs.parse_serve_result(data, FIXTURE_WORKLOAD)["ok"]


def test_a_result_without_percentiles_is_refused():
    data = json.loads(FIXTURE.read_text())
    del data["p50_itl_ms"]
    with pytest.raises(ValueError, match="'p50_itl_ms'.*--metric-percentiles"):
        vs.parse_serve_result(data, FIXTURE_WORKLOAD)
    data = json.loads(FIXTURE.read_text())
    data["output_throughput"] = None
    with pytest.raises(ValueError, match="'output_throughput'"):
        vs.parse_serve_result(data, FIXTURE_WORKLOAD)


def test_ratios_and_best_round():
    ours = {"output_tok_s": 30.0, "itl_p50_ms": 60.0, "ttft_p50_ms": 100.0}
    theirs = {"output_tok_s": 20.0, "itl_p50_ms": 40.0, "ttft_p50_ms": 0.0}
    assert vs.ratios(ours, theirs) == {
        "output_tok_s": 1.5,
        "itl_p50_ms": 1.5,
        "ttft_p50_ms": None,
    }
    runs = [
        {"output_tok_s": 9.0, "ok": False},
        {"output_tok_s": 5.0, "ok": True},
        {"output_tok_s": 7.0, "ok": True},
    ]
    assert vs.best_round(runs)["output_tok_s"] == 7.0
    assert vs.best_round([{"output_tok_s": 3.0, "ok": False}])["output_tok_s"] == 3.0


def test_vllm_environment(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vs.vllm_environment(tmp_path, threads=1, kv_gib=4)
    assert env["LD_PRELOAD"].split(":")[-1] == str(tmp_path / "lib" / "libiomp5.so")
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("4", "0")
    assert vs.vllm_environment(tmp_path, threads=4, kv_gib=2)["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"


def test_physical_ceilings():
    costs = {
        "parameters": 1000,
        "non_embedding_parameters": 800,
        "head_parameters": 200,
        "weight_bytes": 4000,
        "kv_bytes_per_token": 10,
        "layers": 2,
        "hidden": 4,
    }
    ceil = {"copy_gbs": 1e-6, "gemm_gflops": 1e-6}  # 1,000 bytes/s and 1,000 FLOP/s
    workload = vs.Online("c1", 1, 1, 10, 4, 0, 0)
    figures = {"itl_p50_ms": 8000.0, "ttft_p50_ms": 0.0}
    p = vs.physical(costs, ceil, workload, figures)
    assert p["decode_step_bytes"] == 4000 + 12 * 10  # context 10 in + 2 (half the output)
    assert p["decode_floor_ms"] == pytest.approx(4120.0)
    assert p["decode_mbu"] == pytest.approx(4120 / 8000)
    assert p["prefill_flops"] == 2 * 800 * 10 + 2 * 200 + 2 * 2 * 100 * 4
    assert p["prefill_mfu"] is None  # no TTFT measured


def test_table_has_both_engines_and_the_ratio():
    best = {
        "c1": {
            "loraplex": {"output_tok_s": 30.0, "ttft_p50_ms": 200.0, "itl_p50_ms": 40.0},
            "vllm": {"output_tok_s": 20.0, "ttft_p50_ms": 100.0, "itl_p50_ms": 50.0},
        }
    }
    ratio = {"c1": vs.ratios(best["c1"]["loraplex"], best["c1"]["vllm"])}
    lines = vs.table(best, ratio)
    assert [line.split()[:3] for line in lines[1:]] == [
        ["c1", "loraplex", "30.0"],
        ["c1", "vllm", "20.0"],
        ["c1", "ratio", "1.500"],
    ]
    assert lines[3].split()[3:] == ["2.000", "-", "0.800", "-"]


def test_text_less_ids_are_the_lone_bytes_and_special_tokens(tiny_text_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_text_dir)
    banned = vs.text_less_ids(Path(tiny_text_dir))
    assert banned == sorted(banned) and 0 < len(banned) <= 300  # fits logit_bias' bound
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i], skip_special_tokens=True)
        assert (i in banned) == (text == "" or "\ufffd" in text), (i, text)
    assert any(tokenizer.decode([i]) != "" for i in banned)  # lone bytes, not only specials
