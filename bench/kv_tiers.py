"""Benchmark: KV tiers (issue 32): a returning conversation's TTFT from each tier vs recompute.

A conversation's first turn is a ``--context``-token prompt (4,096 by default) and a 16-token
greedy answer; its second turn adds a 64-token user message. Between the turns the first
turn's blocks leave the pool (``reset_prefix_cache``: every hash dropped, as an eviction
would), so the second turn's prefix comes back:

- **recompute**: an engine without tiers prefills all of it again (the baseline);
- **host**: from the host-memory tier of the same engine (``--kv-offloading-size``);
- **disk**: from the local-disk tier of the same engine (``--kv-disk-dir``; the file pages
  were just written, so the OS page cache serves most reads: this is the disk tier's code
  path, not the device's speed);
- **restart**: a new engine on the disk tier's directory (the first one shut down);
- **replica**: another engine sharing a Redis tier (``--kv-remote-url``; a ``redis-server``
  this bench starts on loopback) that the first engine wrote.

TTFT is from ``add_request`` to the step that returns the first token, median of ``--rounds``
conversations, each used once per tier. Targets (issue 32): host <= 0.2x, disk <= 0.3x,
restart <= 0.3x, replica <= 0.4x recompute's TTFT. Then the **decode rate** of 8 other
requests while a disk load runs, over the mean of their rate just before and just after
(target >= 0.9x), and the copy
rates the tiers move at (bytes loaded over the load time) next to this machine's own memory
copy and file write/read rates, measured in the same run.

Model: ``--preset`` (default ``smollm2-135m``: SmolLM2-135M's shape, 30 layers, GQA 9/3, 8,192
positions, random weights; float32: 46,080 bytes of KV per token). ``--quick``: the tiny preset,
a 512-token context, one round.

Run: ``python -m bench.kv_tiers [--quick] [--context N] [--rounds R]``. Prints a table, then
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.presets import PRESETS, kv_bytes_per_token, preset_dir
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

ANSWER = 16
FOLLOW_UP = 64
OTHERS = 8
OTHERS_MAX_TOKENS = 1024
TARGETS = {"host": 0.2, "disk": 0.3, "restart": 0.3, "replica": 0.4}


def conversation(seed: int, context: int, vocab: int) -> list[int]:
    """The first turn's prompt of conversation ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab, (context,), generator=g).tolist()


def follow_up(seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(16, vocab, (FOLLOW_UP,), generator=g).tolist()


def make(model: Path, blocks: int, **tiers) -> LLM:
    return LLM(
        EngineConfig(model=str(model), num_kv_blocks=blocks, max_num_batched_tokens=2048, **tiers)
    )


def first_turn(llm: LLM, rid: str, prompt: list[int]) -> list[int]:
    """Run turn one; return turn two's prompt (prompt + answer + follow-up)."""
    req = EngineRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=ANSWER))
    (out,) = llm.generate([req])
    return out.outputs[0].token_ids


def settle(llm: LLM) -> None:
    """Wait until every offload is copied out and written to every tier."""
    core = llm.engine.core
    tiers = core.kv_tiers
    while tiers.busy:
        tiers.wait(0.05)
        tiers.poll(core.scheduler.add)
    tiers.store.flush(120)


def ttft(llm: LLM, rid: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the first token, and the cached tokens it reported."""
    engine = llm.engine
    req = EngineRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=1))
    t0 = time.perf_counter()
    engine.add_request(req)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.outputs and out.outputs[0].token_ids:
                elapsed = time.perf_counter() - t0
                while engine.has_unfinished_requests():
                    engine.step()
                return elapsed, out.num_cached_tokens


def redis_url(directory: str) -> tuple[str, subprocess.Popen]:
    """Start a throwaway ``redis-server`` on loopback; its URL and process.

    Raises:
        RuntimeError: no redis-server on PATH, or it did not answer within 10 s.
    """
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("bench.kv_tiers needs redis-server (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", directory],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.from_url(url).ping()
            return url, proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def copy_rates(directory: str, nbytes: int) -> dict[str, float]:
    """This machine's memory copy and file write (fsynced) / read rates, in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    memory = 3 * nbytes / (time.perf_counter() - t0)
    path = Path(directory) / "copy-rate.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(src.numpy()))
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        data = f.read()
    read = len(data) / (time.perf_counter() - t0)
    path.unlink()
    return {
        "memory_copy_gbps": memory / 1e9,
        "file_write_gbps": write / 1e9,
        "file_read_gbps": read / 1e9,
    }


def tier_rate(llm: LLM, name: str) -> float | None:
    """GB/s a tier's loads read at (bytes loaded over their seconds), or None."""
    row = llm.engine.core.kv_tiers.store.stats()["tiers"].get(name)
    if not row or not row["load_seconds"]:
        return None
    return row["loaded_bytes"] / row["load_seconds"] / 1e9


def decode_rate_during_load(
    llm: LLM, prompt: list[int], vocab: int, window: float
) -> dict[str, float]:
    """Tokens/s of OTHERS decoding requests while ``prompt``'s tier load runs.

    Over the mean of their rate in a window just before and one just after (their rate drifts
    as their contexts grow and the machine's load changes).
    """
    engine = llm.engine
    core = engine.core
    for i in range(OTHERS):
        engine.add_request(
            EngineRequest(
                f"other{i}",
                conversation(500 + i, 64, vocab),
                SamplingParams(temperature=0, max_tokens=OTHERS_MAX_TOKENS, ignore_eos=True),
            )
        )
    while core.scheduler.waiting or any(s.num_computed_tokens < 64 for s in core.scheduler.running):
        engine.step()  # prefills done: from here the others only decode

    def run(seconds: float | None, until=None) -> tuple[int, float]:
        tokens, t0 = 0, time.perf_counter()
        while True:
            tokens += sum(
                len(o.outputs[0].token_ids)
                for o in engine.step()
                if o.request_id.startswith("other") and o.outputs
            )
            elapsed = time.perf_counter() - t0
            if (seconds is not None and elapsed >= seconds) or (until is not None and until()):
                return tokens, elapsed

    before_tokens, before_s = run(window)
    engine.add_request(EngineRequest("loaded", prompt, SamplingParams(temperature=0, max_tokens=1)))
    waiting = "loaded" in core.kv_tiers
    during_tokens, during_s = run(None, until=lambda: "loaded" not in core.kv_tiers)
    after_tokens, after_s = run(window)  # the others' rate drifts: average before and after
    for i in range(OTHERS):
        engine.abort_request(f"other{i}")
    while engine.has_unfinished_requests():
        engine.step()
    before, during = before_tokens / before_s, during_tokens / max(during_s, 1e-9)
    after = after_tokens / after_s
    baseline = (before + after) / 2
    return {
        "others_tok_s_before": before,
        "others_tok_s_after": after,
        "others_tok_s_during_load": during,
        "load_seconds": during_s,
        "ratio": during / baseline if baseline else float("nan"),
        "load_started": bool(waiting),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 512 tokens, 1 round")
    parser.add_argument("--preset", choices=PRESETS, default=None)
    parser.add_argument("--context", type=int, default=None, help="turn one's prompt tokens")
    parser.add_argument("--rounds", type=int, default=None, help="conversations per tier")
    args = parser.parse_args()
    preset = args.preset or ("tiny" if args.quick else "smollm2-135m")
    context = args.context or (512 if args.quick else 4096)
    rounds = args.rounds or (1 if args.quick else 2)
    model = preset_dir(preset)
    config = json.loads((model / "config.json").read_text())
    vocab = min(config["vocab_size"], 49152)
    per_token = kv_bytes_per_token(config, 4)
    turn_two = context + ANSWER + FOLLOW_UP
    blocks = 2 * (-(-turn_two // 16)) + OTHERS * (-(-(64 + OTHERS_MAX_TOKENS) // 16)) + 64
    big = 2 * (rounds * 2 + 2) * turn_two * per_token  # every conversation's turns, twice over
    work = tempfile.mkdtemp(prefix="kv-tiers-bench-")
    url, redis_proc = redis_url(work)
    disk = {"kv_disk_dir": f"{work}/disk", "kv_disk_bytes": big}
    remote = {"kv_remote_url": url, "kv_remote_bytes": big}
    results: dict[str, list[float]] = {k: [] for k in ("recompute", *TARGETS)}
    cached: dict[str, list[int]] = {k: [] for k in results}
    rates: dict[str, float | None] = {}
    convs = {}

    def second(seed: int, answer: list[int]) -> list[int]:
        return conversation(seed, context, vocab) + answer + follow_up(seed, vocab)

    try:
        t_start = time.perf_counter()
        # Recompute: no tiers; the second turn of a conversation the pool evicted.
        llm = make(model, blocks)
        for r in range(rounds):
            answer = first_turn(llm, f"c{r}", conversation(r, context, vocab))
            assert llm.engine.kv.reset_prefix_cache()
            t, c = ttft(llm, f"c{r}b", second(r, answer))
            results["recompute"].append(t)
            cached["recompute"].append(c)
        llm.shutdown()
        # Host tier.
        llm = make(model, blocks, kv_offloading_bytes=big)
        for r in range(rounds):
            seed = 100 + r
            answer = first_turn(llm, f"h{r}", conversation(seed, context, vocab))
            settle(llm)
            assert llm.engine.kv.reset_prefix_cache()
            t, c = ttft(llm, f"h{r}b", second(seed, answer))
            results["host"].append(t)
            cached["host"].append(c)
        rates["host"] = tier_rate(llm, "host")
        llm.shutdown()
        # Disk + shared tiers written by one engine; the disk read back by it, then a restart
        # and another replica read the other conversations.
        llm = make(model, blocks, **disk, **remote)
        for r in range(3 * rounds + 1):
            seed = 200 + r
            convs[seed] = first_turn(llm, f"d{r}", conversation(seed, context, vocab))
        settle(llm)
        for r in range(rounds):
            assert llm.engine.kv.reset_prefix_cache()
            seed = 200 + r
            t, c = ttft(llm, f"d{r}b", second(seed, convs[seed]))
            results["disk"].append(t)
            cached["disk"].append(c)
        rates["disk"] = tier_rate(llm, "disk")
        llm.shutdown()
        restarted = make(model, blocks, **disk)
        for r in range(rounds, 2 * rounds):
            seed = 200 + r
            t, c = ttft(restarted, f"s{r}b", second(seed, convs[seed]))
            results["restart"].append(t)
            cached["restart"].append(c)
        last = 200 + 3 * rounds
        decode = decode_rate_during_load(
            restarted, second(last, convs[last]), vocab, 0.5 if args.quick else 2.0
        )
        restarted.shutdown()
        replica = make(model, blocks, **remote)
        for r in range(2 * rounds, 3 * rounds):
            seed = 200 + r
            t, c = ttft(replica, f"p{r}b", second(seed, convs[seed]))
            results["replica"].append(t)
            cached["replica"].append(c)
        rates["remote"] = tier_rate(replica, "remote")
        replica.shutdown()
        machine = copy_rates(work, 256 << 20)
        wall = time.perf_counter() - t_start
    finally:
        redis_proc.kill()
        shutil.rmtree(work, ignore_errors=True)

    base = statistics.median(results["recompute"])
    print(f"{preset}, {context}-token conversation + {ANSWER} + {FOLLOW_UP}; {rounds} round(s)")
    print(f"KV bytes per token: {per_token}; block of 16: {16 * per_token}")
    print(f"{'tier':<10} {'TTFT ms':>9} {'x recompute':>12} {'target':>7} {'cached tokens':>14}")
    ratios = {}
    for name, values in results.items():
        med = statistics.median(values)
        ratio = med / base
        ratios[name] = ratio
        target = f"<={TARGETS[name]}" if name in TARGETS else ""
        print(f"{name:<10} {med * 1e3:>9.1f} {ratio:>12.3f} {target:>7} {min(cached[name]):>14}")
    print(
        f"decode rate of {OTHERS} others during a disk load: {decode['ratio']:.2f}x "
        f"({decode['others_tok_s_during_load']:.1f} tok/s; "
        f"{decode['others_tok_s_before']:.1f} before, {decode['others_tok_s_after']:.1f} after; "
        f"load {decode['load_seconds'] * 1e3:.0f} ms; target >= 0.9)"
    )
    print(
        "tier load rates (GB/s): "
        + ", ".join(f"{k} {v:.2f}" if v else f"{k} -" for k, v in rates.items())
        + "; machine: "
        + ", ".join(f"{k} {v:.2f}" for k, v in machine.items())
    )
    print(
        json.dumps(
            {
                "bench": "kv_tiers",
                "preset": preset,
                "context": context,
                "rounds": rounds,
                "kv_bytes_per_token": per_token,
                "ttft_s": {k: statistics.median(v) for k, v in results.items()},
                "ttft_ratio": ratios,
                "cached_tokens": {k: min(v) for k, v in cached.items()},
                "targets": TARGETS,
                "decode_during_load": decode,
                "tier_load_gbps": rates,
                "machine_gbps": machine,
                "wall_s": wall,
            }
        )
    )


if __name__ == "__main__":
    main()
