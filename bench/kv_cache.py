"""Benchmark: block hashing and KV block allocate + free (issue 2's figures).

(a) Hashing a 2,048-token prompt with ``RequestBlockHasher`` (a fresh hasher, so per-request and
    per-block overhead are included), SHA-256 and xxh3-128, in ns per token; beside it, in the
    same run, the floor: one bare digest per 16-token block of packed tokens, no chaining, no
    framing.
(b) Allocating and then freeing the blocks of a 2,048-token request whose block hashes were
    already computed (prefix lookup + ``allocate_slots`` + ``free``), in microseconds:
    on a miss in a warm pool (every free block cached, so each allocation evicts), and on a full
    prefix hit (the same prompt again after the first was freed); at several pool sizes to show
    the cost is flat in the pool size.

Run: ``python -m bench.kv_cache [--quick]``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import xxhash

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.hashing.block_hash import pack_token_ids
from loraplex.hashing.request_hasher import RequestBlockHasher

BLOCK_SIZE = 16
PROMPT_TOKENS = 2048
POOL_BLOCKS = 4096


def _best_per_call(fn, calls: int, repeats: int) -> float:
    """Best-of-``repeats`` mean seconds per call of ``fn`` over ``calls`` calls."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def prompt(seed: int) -> list[int]:
    """A deterministic 2,048-token prompt; different seeds share no block."""
    return [(seed * 7919 + i * 31) % 128_000 for i in range(PROMPT_TOKENS)]


def bench_hashing(repeats: int) -> dict[str, float]:
    tokens = prompt(1)
    out: dict[str, float] = {}
    for algorithm in ("sha256", "xxhash"):
        secs = _best_per_call(
            lambda a=algorithm: RequestBlockHasher(BLOCK_SIZE, algorithm=a).extend(tokens),
            calls=100,
            repeats=repeats,
        )
        out[algorithm] = secs / PROMPT_TOKENS * 1e9

    nbytes = 4 * BLOCK_SIZE

    def floor(digest):
        packed = pack_token_ids(tokens)
        for lo in range(0, len(packed), nbytes):
            digest(packed[lo : lo + nbytes])

    sha = _best_per_call(
        lambda: floor(lambda b: hashlib.sha256(b).digest()), calls=100, repeats=repeats
    )
    xxh = _best_per_call(lambda: floor(xxhash.xxh3_128_digest), calls=100, repeats=repeats)
    out["sha256_floor"] = sha / PROMPT_TOKENS * 1e9
    out["xxhash_floor"] = xxh / PROMPT_TOKENS * 1e9
    return out


def bench_alloc_free(num_blocks: int, repeats: int, distinct: int) -> tuple[float, float]:
    """(miss us, hit us) per allocate + free of one 2,048-token request."""
    manager = KVCacheManager(num_blocks, BLOCK_SIZE)
    hashes = []
    for seed in range(distinct):
        hasher = RequestBlockHasher(BLOCK_SIZE)
        hasher.extend(prompt(seed + 10))
        hashes.append(hasher.block_hashes)

    def run(request_id: str, block_hashes: list[bytes]) -> int:
        match = manager.get_computed_blocks(block_hashes, PROMPT_TOKENS)
        alloc = manager.allocate_slots(
            request_id,
            PROMPT_TOKENS - match.num_cached_tokens,
            prefix=match,
            block_hashes=block_hashes,
        )
        assert alloc is not None
        manager.free(request_id)
        return match.num_cached_tokens

    # Warm the pool: fill every free block with cached content so misses evict.
    while len(manager.pool.cached) < min(num_blocks, distinct * PROMPT_TOKENS // BLOCK_SIZE):
        for i, block_hashes in enumerate(hashes):
            run(f"warm-{i}", block_hashes)
        if distinct * PROMPT_TOKENS // BLOCK_SIZE < num_blocks:
            break
    miss_times = []
    hit_times = []
    cursor = 0
    for _ in range(repeats):
        # Misses: requests whose blocks were evicted long ago (the pool holds the newest).
        batch = []
        for _ in range(20):
            batch.append(hashes[cursor % distinct])
            cursor += 1
        t0 = time.perf_counter()
        cached = [run(f"miss-{i}", block_hashes) for i, block_hashes in enumerate(batch)]
        miss_times.append((time.perf_counter() - t0) / len(batch))
        assert not any(cached), "a miss request hit the cache: the cycle is too short"
        # Hits: the same prompt again after the first was freed.
        hot = hashes[(cursor - 1) % distinct]
        t0 = time.perf_counter()
        for i in range(20):
            cached = run(f"hit-{i}", hot)
        hit_times.append((time.perf_counter() - t0) / 20)
        assert cached == PROMPT_TOKENS - BLOCK_SIZE
    return min(miss_times) * 1e6, min(hit_times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (< 60 s)")
    args = parser.parse_args()
    repeats = 10 if args.quick else 40

    h = bench_hashing(repeats)
    pools = [1024, POOL_BLOCKS] if args.quick else [1024, POOL_BLOCKS, 65536]
    alloc = {}
    for num_blocks in pools:
        # Enough distinct prompts that each miss evicts: the pool holds num_blocks / 128 prompts.
        distinct = num_blocks // (PROMPT_TOKENS // BLOCK_SIZE) * 2 + 2
        alloc[num_blocks] = bench_alloc_free(num_blocks, repeats, distinct)

    print(f"block size {BLOCK_SIZE}, prompt {PROMPT_TOKENS} tokens, best of {repeats}")
    print(f"{'hashing':<34}{'ns/token':>10}{'floor':>10}{'x floor':>10}")
    for name in ("sha256", "xxhash"):
        ratio = h[name] / h[f"{name}_floor"]
        print(
            f"{'RequestBlockHasher ' + name:<34}{h[name]:>10.1f}{h[name + '_floor']:>10.1f}"
            f"{ratio:>10.2f}"
        )
    print(f"{'allocate + free, 128 blocks':<34}{'miss us':>10}{'hit us':>10}")
    for num_blocks, (miss, hit) in alloc.items():
        print(f"{'pool ' + str(num_blocks) + ' blocks':<34}{miss:>10.1f}{hit:>10.1f}")
    miss, hit = alloc[POOL_BLOCKS]
    print(
        json.dumps(
            {
                "hash_sha256_ns_per_token": round(h["sha256"], 1),
                "hash_xxhash_ns_per_token": round(h["xxhash"], 1),
                "alloc_free_us": round(miss, 1),
                "alloc_free_hit_us": round(hit, 1),
                "sha256_floor_ns_per_token": round(h["sha256_floor"], 1),
                "xxhash_floor_ns_per_token": round(h["xxhash_floor"], 1),
                "sha256_ratio_vs_floor": round(h["sha256"] / h["sha256_floor"], 2),
                "xxhash_ratio_vs_floor": round(h["xxhash"] / h["xxhash_floor"], 2),
                "alloc_free_us_by_pool": {str(k): round(v[0], 1) for k, v in alloc.items()},
                "alloc_free_hit_us_by_pool": {str(k): round(v[1], 1) for k, v in alloc.items()},
                "pool_blocks": POOL_BLOCKS,
            }
        )
    )


if __name__ == "__main__":
    main()
