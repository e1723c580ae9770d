"""Benchmark: which existing store backs the KV tier shared by replicas (issue 32 item 3).

Puts and gets of block-sized records (codec frames of the real SmolLM2-135M KV shape: 30
layers, 3 KV heads of 64, blocks of 16 tokens; 737,280 bytes a block in float32, 368,640 in
bfloat16) against each candidate on this machine: Redis (a ``redis-server`` on loopback,
redis-py, one command per block and pipelined batches), an fsspec filesystem (``file://`` on a
directory standing in for a shared mount, ``memory://`` as the in-process floor; S3 or GCS would
go through the same calls), and Ray's object store (``ray.put`` / ``ray.get``, with a named
actor holding the key -> ObjectRef index, the home-made part Ray needs). Also the tier as
built (``RedisTier``: checksum verified, LRU script), the checksums the record could carry, and
a memory copy of a block for scale. Every record read back is compared with what was written.

Per candidate and dtype: microseconds per block for single puts, single gets and gets in
batches of 16, and per key for a batched existence check of ``blocks`` keys (the prefix
lookup); GB/s of block bytes. Medians of ``rounds`` rounds, fresh keys each round.

Run: ``python -m bench.kv_shared_tier [--quick] [--redis-url URL] [--no-ray]``. Prints a table,
then one JSON line. docs/kv_tiers.md has the figures and the choice.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
import zlib
from datetime import UTC, datetime

import numpy as np
import torch
import xxhash

from bench.ratelimit import start_redis
from loraplex.engine.kv_cache.tiers import (
    DiskTier,
    HostTier,
    KVLayout,
    RedisTier,
    TieredStore,
    codec,
)

SMOLLM2 = KVLayout("HuggingFaceTB/SmolLM2-135M", "float32", 16, 30, 3, 64, "sha256")
BATCH = 16


def key_of(round_: int, i: int) -> bytes:
    return hashlib.sha256(f"{round_}:{i}".encode()).digest()


class RedisRaw:
    """redis-py SET / GET of the frames, pipelines for batches."""

    def __init__(self, url: str, *, pure_python: bool = False) -> None:
        import redis

        kw = {}
        if pure_python:  # redis-py's own reply parser, as without ``hiredis`` installed
            from redis._parsers import _RESP2Parser

            kw["parser_class"] = _RESP2Parser
        self.name = "redis-pyparser" if pure_python else "redis"
        self.r = redis.Redis.from_url(url, **kw)

    def put(self, key, frame, payload):
        """Store one frame (``payload`` is its block, for the tier as built)."""
        self.r.set(b"bench:" + key, frame)

    def get(self, key):
        """One record, or None."""
        return self.r.get(b"bench:" + key)

    def get_many(self, keys):
        """Records of ``keys`` (None where absent), in one call."""
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.get(b"bench:" + k)
        return pipe.execute()

    def contains_many(self, keys):
        """Whether each key is stored, in one call."""
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.exists(b"bench:" + k)
        return [bool(x) for x in pipe.execute()]

    def clear(self):
        """Delete every record of the run."""
        self.r.flushdb()

    def close(self):
        """Release the candidate."""
        self.r.close()


class RedisTierCandidate:
    """The tier as built: frames verified on read, the LRU bound kept by a Lua script."""

    name = "RedisTier"

    def __init__(self, url: str, layout: KVLayout) -> None:
        self.layout = layout
        self.tier = RedisTier(url, layout, 1 << 40, namespace="bench")

    def put(self, key, frame, payload):
        """Store one frame (``payload`` is its block, for the tier as built)."""
        assert self.tier.put(key, payload)

    def get(self, key):
        """One record, or None."""
        return self.tier.get(key)

    def get_many(self, keys):
        """Records of ``keys`` (None where absent), in one call."""
        return self.tier.get_many(keys)

    def contains_many(self, keys):
        """Whether each key is stored, in one call."""
        return self.tier.contains_many(keys)

    def clear(self):
        """Delete every record of the run."""
        self.tier.clear()

    def close(self):
        """Release the candidate."""
        self.tier.close()


class Fsspec:
    """An fsspec filesystem: one object per block (``pipe_file`` / ``cat_file``)."""

    def __init__(self, protocol: str, root: str) -> None:
        import fsspec

        self.name = f"fsspec-{protocol}"
        self.fs = fsspec.filesystem(protocol)
        self.root = root
        self.fs.makedirs(root, exist_ok=True)

    def path(self, key):
        """The object path of ``key``."""
        return f"{self.root}/{key.hex()}.kv"  # flat, as objects in a bucket

    def put(self, key, frame, payload):
        """Store one frame (``payload`` is its block, for the tier as built)."""
        self.fs.pipe_file(self.path(key), frame)

    def get(self, key):
        """One record, or None."""
        return self.fs.cat_file(self.path(key))

    def get_many(self, keys):
        """Records of ``keys`` (None where absent), in one call."""
        paths = [self.path(k) for k in keys]
        got = self.fs.cat(paths, on_error="omit")
        return [got.get(p) for p in paths]

    def contains_many(self, keys):
        """Whether each key is stored, in one call."""
        return [self.fs.exists(self.path(k)) for k in keys]

    def clear(self):
        """Delete every record of the run."""
        if self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)
        self.fs.makedirs(self.root, exist_ok=True)

    def close(self):
        """Release the candidate."""
        self.clear()


def start_moto(directory: str):
    """Start moto's S3 server in a subprocess on a free loopback port; its process and endpoint."""
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=directory,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    raise SystemExit("moto's S3 server did not start")


class S3:
    """fsspec's ``s3://`` (s3fs) against moto's S3 server on loopback: the object-store path."""

    name = "fsspec-s3-moto"

    def __init__(self, endpoint: str) -> None:
        import s3fs

        # moto takes any credentials; the region as tests/s3_server.py sets it.
        os.environ.update(
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=endpoint,
        )
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True)
        self.fs.mkdir("kvbench")
        self.root = "kvbench/kv"

    path = Fsspec.path
    put = Fsspec.put
    get = Fsspec.get
    get_many = Fsspec.get_many

    def contains_many(self, keys):
        """Whether each key is stored (a HEAD per key)."""
        self.fs.invalidate_cache()
        return [self.fs.exists(self.path(k)) for k in keys]

    def clear(self):
        """Delete every record of the run."""
        self.fs.rm(self.fs.find(self.root))
        self.fs.invalidate_cache()

    def close(self):
        """Release the candidate."""


class RayStore:
    """Ray's object store, and a named actor as the key -> ObjectRef index."""

    name = "ray"

    def __init__(self) -> None:
        import ray

        self.ray = ray

        @ray.remote(num_cpus=0)
        class Index:
            def __init__(self):
                self.refs = {}

            def register(self, items):
                for key, boxed in items:
                    self.refs[key] = boxed[0]

            def lookup(self, keys):
                return [[self.refs[k]] if k in self.refs else None for k in keys]

            def contains(self, keys):
                return [k in self.refs for k in keys]

            def clear(self):
                self.refs.clear()

        self.index = Index.options(name="kv-index", get_if_exists=True).remote()

    def put(self, key, frame, payload):
        """Store one frame (``payload`` is its block, for the tier as built)."""
        ref = self.ray.put(np.frombuffer(frame, dtype=np.uint8))
        self.ray.get(self.index.register.remote([(key, [ref])]))

    def get(self, key):
        """One record, or None."""
        return self.get_many([key])[0]

    def get_many(self, keys):
        """Records of ``keys`` (None where absent), in one call."""
        boxes = self.ray.get(self.index.lookup.remote(keys))
        refs = [b[0] for b in boxes if b is not None]
        got = iter(self.ray.get(refs))
        return [next(got) if b is not None else None for b in boxes]

    def contains_many(self, keys):
        """Whether each key is stored, in one call."""
        return self.ray.get(self.index.contains.remote(keys))

    def clear(self):
        """Delete every record of the run."""
        self.ray.get(self.index.clear.remote())

    def close(self):
        """Release the candidate."""
        self.clear()


def same(got, frame: bytes, payload: torch.Tensor) -> bool:
    if isinstance(got, torch.Tensor):
        return torch.equal(got, payload)
    return got is not None and bytes(memoryview(got).cast("B")) == frame


def measure(cand, layout: KVLayout, blocks: int, rounds: int) -> dict:
    """Median figures of ``rounds`` rounds of ``blocks`` fresh blocks."""
    rows: dict[str, list[float]] = {"put": [], "get": [], "get_batch": [], "contains": []}
    gen = torch.Generator().manual_seed(0)
    payloads = [
        torch.randint(0, 256, (layout.block_nbytes,), dtype=torch.uint8, generator=gen)
        for _ in range(min(blocks, 16))
    ]
    bad = 0
    for r in range(rounds + 1):  # round 0 warms connections and caches
        ks = [key_of(r, i) for i in range(blocks)]
        items = [(k, payloads[i % len(payloads)]) for i, k in enumerate(ks)]
        frames = [codec.encode(k, p, layout) for k, p in items]
        t0 = time.perf_counter()
        for (k, p), f in zip(items, frames, strict=True):
            cand.put(k, f, p)
        t1 = time.perf_counter()
        got = [cand.get(k) for k in ks]
        t2 = time.perf_counter()
        batched = []
        for i in range(0, blocks, BATCH):
            batched.extend(cand.get_many(ks[i : i + BATCH]))
        t3 = time.perf_counter()
        present = cand.contains_many(ks + [key_of(-1, i) for i in range(blocks)])
        t4 = time.perf_counter()
        for g, b, f, (_, p) in zip(got, batched, frames, items, strict=True):
            bad += (not same(g, f, p)) + (not same(b, f, p))
        bad += present != [True] * blocks + [False] * blocks
        cand.clear()
        if r:
            rows["put"].append((t1 - t0) / blocks)
            rows["get"].append((t2 - t1) / blocks)
            rows["get_batch"].append((t3 - t2) / blocks)
            rows["contains"].append((t4 - t3) / (2 * blocks))
    med = {name: statistics.median(v) for name, v in rows.items()}
    out = {f"{name}_us": round(s * 1e6, 1) for name, s in med.items()}
    for name in ("put", "get", "get_batch"):
        out[f"{name}_GBps"] = round(layout.block_nbytes / med[name] / 1e9, 2)
    out["mismatches"] = bad
    return out


def checksum_rates(nbytes: int) -> dict:
    """GB/s of each checksum on one block (in cache) and on ``nbytes`` (out of cache)."""
    fns = {
        "xxh3_64": xxhash.xxh3_64_intdigest,
        "crc32": zlib.crc32,
        "blake2b": lambda m: hashlib.blake2b(m).digest(),
        "sha256": lambda m: hashlib.sha256(m).digest(),
    }
    out = {}
    for size_name, size in (("block", SMOLLM2.block_nbytes), ("large", nbytes)):
        buf = memoryview(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8))
        for name, fn in fns.items():
            fn(buf)
            best = min(_time(fn, buf) for _ in range(5 if size_name == "block" else 2))
            out[f"{name}/{size_name}"] = round(size / best / 1e9, 2)
    return out


def _time(fn, buf) -> float:
    t0 = time.perf_counter()
    fn(buf)
    return time.perf_counter() - t0


def memcpy_rate() -> float:
    """GB/s of copying one float32 block's payload (``dst.copy_(src)``), best of 50."""
    src = torch.ones(SMOLLM2.block_nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_time(lambda _: dst.copy_(src), None) for _ in range(50))
    return round(SMOLLM2.block_nbytes / best / 1e9, 2)


def store_loads(url: str, directory: str, blocks: int, rounds: int) -> dict:
    """``TieredStore.load_prefix`` of ``blocks`` float32 blocks from each tier alone.

    Host, disk (files in the page cache, as right after they were written) and Redis, each
    behind its own store (no promotion); the median of ``rounds`` loads, every payload checked.

    Returns:
        Per tier: milliseconds for the prefix, microseconds and GB/s per block, mismatches.
    """
    layout = SMOLLM2
    ks = [key_of(-2, i) for i in range(blocks)]
    gen = torch.Generator().manual_seed(1)
    payloads = [
        torch.randint(0, 256, (layout.block_nbytes,), dtype=torch.uint8, generator=gen)
        for _ in range(blocks)
    ]
    cap = 2 * blocks * codec.frame_nbytes(32, layout)
    tiers = {
        "host": HostTier(cap),
        "disk": DiskTier(os.path.join(directory, "disk"), cap, layout),
        "remote": RedisTier(url, layout, cap, namespace="bench-store"),
    }
    out = {}
    for name, tier in tiers.items():
        store = TieredStore([tier], max_pending_bytes=cap)
        for k, p in zip(ks, payloads, strict=True):
            store.offer(k, p)
        assert store.flush(120)
        times, bad = [], 0
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            got = store.load_prefix(ks).result(120)
            times.append(time.perf_counter() - t0)
            bad += len(got) != blocks or any(
                not torch.equal(g, p) for g, p in zip(got, payloads, strict=False)
            )
        seconds = statistics.median(times[1:])
        out[name] = {
            "prefix_ms": round(seconds * 1e3, 1),
            "us_per_block": round(seconds / blocks * 1e6, 1),
            "GBps": round(blocks * layout.block_nbytes / seconds / 1e9, 2),
            "mismatches": bad,
        }
        if name == "remote":
            tier.clear()
        store.close()
    return out


def main() -> None:
    """Parse the flags, start Redis (and Ray) unless told otherwise, run, print, JSON last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="48 blocks x 2 rounds")
    parser.add_argument("--redis-url", default=None, help="a Redis to use (its db is FLUSHED)")
    parser.add_argument("--no-ray", action="store_true", help="leave Ray's object store out")
    parser.add_argument("--no-s3", action="store_true", help="leave s3:// (moto) out")
    args = parser.parse_args()
    blocks, rounds = (48, 2) if args.quick else (256, 5)
    layouts = {
        "float32": SMOLLM2,
        "bfloat16": KVLayout(**{**SMOLLM2.__dict__, "dtype": "bfloat16"}),
    }
    results: dict[str, dict] = {}
    ray_init_s = None
    proc = None
    with tempfile.TemporaryDirectory() as directory:
        url = args.redis_url
        if url is None:
            proc, url = start_redis(directory)
        cands = [
            RedisRaw(url),
            RedisRaw(url, pure_python=True),
            Fsspec("file", os.path.join(directory, "shared")),
            Fsspec("memory", "/kv-bench"),
        ]
        moto = None
        if not args.no_s3:
            moto, endpoint = start_moto(directory)
            cands.append(S3(endpoint))
        if not args.no_ray:
            import ray

            t0 = time.perf_counter()
            ray.init(
                num_cpus=1,
                include_dashboard=False,
                logging_level="ERROR",
                object_store_memory=512 << 20,
                log_to_driver=False,
            )
            ray_init_s = round(time.perf_counter() - t0, 2)
            cands.append(RayStore())
        try:
            for dtype, layout in layouts.items():
                for cand in [*cands, RedisTierCandidate(url, layout)]:
                    results[f"{cand.name}/{dtype}"] = measure(cand, layout, blocks, rounds)
                    if isinstance(cand, RedisTierCandidate):
                        cand.close()
            for cand in cands:
                cand.close()
            loads = store_loads(url, directory, blocks, rounds)
        finally:
            if not args.no_ray:
                import ray

                ray.shutdown()
            for p in (proc, moto):
                if p is not None:
                    p.terminate()
                    p.wait(10)
    sums = checksum_rates((64 if args.quick else 256) << 20)
    shared = [
        n
        for n in results
        if n.endswith("/float32") and "memory" not in n and not n.startswith("RedisTier")
    ]
    fastest = min(shared, key=lambda n: results[n]["get_batch_us"]).split("/")[0]
    redis_f32 = results["redis/float32"]
    result = {
        "bench": "kv_shared_tier",
        "quick": args.quick,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}",
        "blocks": blocks,
        "rounds": rounds,
        "batch": BATCH,
        "block_nbytes": {d: lay.block_nbytes for d, lay in layouts.items()},
        "results": results,
        "store_load_float32": loads,
        "ray_init_s": ray_init_s,
        "checksum_GBps": sums,
        "memcpy_block_GBps": memcpy_rate(),
        "fastest_shared_get_batch": fastest,
        "ratios": {
            f"{n.split('/')[0]}_over_redis_get_batch": round(
                results[n]["get_batch_us"] / redis_f32["get_batch_us"], 2
            )
            for n in results
            if n.endswith("/float32") and not n.startswith("redis/")
        },
        "mismatches": sum(r["mismatches"] for r in [*results.values(), *loads.values()]),
        "choice": "redis",
    }
    cols = ["put_us", "get_us", "get_batch_us", "contains_us", "get_batch_GBps"]
    print(f"{'candidate':<26}" + "".join(f"{c:>15}" for c in cols))
    for name, row in results.items():
        print(f"{name:<26}" + "".join(f"{row[c]:>15}" for c in cols))
    for name, row in loads.items():
        print(f"TieredStore.load_prefix of {blocks} float32 blocks from {name}: {row}")
    print("checksums GB/s:", sums, "| memcpy of a block GB/s:", result["memcpy_block_GBps"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
