"""Benchmark: N engine replicas behind the router against one replica with N times the pool.

Issue 18 item 4. On the built-in tiny LLaVA, a multi-tenant workload: ``T`` tenants of Zipf
popularity (s = 1.1), each with 3 system prompts (Zipf within the tenant) of one photo (its
image tokens, keyed by the photo's pixels) and about 200 tokens of text, 2 LoRA adapters or the
base model (Zipf), a unique question of 10-40 words after the system prompt, 16 output tokens,
greedy, EOS ignored; each tenant's requests carry its cache salt (so tenants share nothing, as
in ``serve``). Prompts are processed once, by the gateway-side processor, before the runs.
The requests run closed-loop with ``--concurrency`` in flight, through the same
``ReplicaRouter`` (``engine.client.replicas``) under the gateway's one front, on:

- ``one-big``: one replica whose KV pool has ``N`` times the blocks;
- ``router``: ``N`` replicas, this router (cached blocks + resident adapter - queued tokens);
- ``round-robin`` and ``least-loaded``: the same ``N`` replicas with the baselines.

The pool of one replica is smaller than the workload's working set, so where each tenant's
prefixes go decides how much is evicted. Reported per configuration: prefix-cache hit rate
(cached prompt tokens over prompt tokens), adapter loads into device slots (2 slots per
replica), output tokens/s, TTFT p50/p99 (from the client). Target: the router's hit rate at
least 95% of one-big's, and clearly above round-robin's and least-loaded's. Replicas are child
processes (``--ray``: Ray actors on a local Ray instance); on a 2-core machine they share the
cores, so tokens/s and TTFT are noisy; the hit rates and loads are not.

Run: ``python -m bench.scale [--quick] [--replicas N] [--ray]``. Prints a table, then one JSON
line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

from bench.multi_lora import write_adapters
from loraplex.adapters.store import AdapterStore
from loraplex.engine.client.front import AsyncLLM
from loraplex.engine.client.replicas import ReplicaRouter
from loraplex.engine.client.router import RoutingPolicy
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.gateway.server.build import start_cores
from loraplex.gateway.settings import data_dir

POOL_BLOCKS = 256  # per replica: less than the hot working set
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "cat", "hubble_deep_field")
WORDS = (
    "river mountain song bird quick lazy fox dog bread honey cat city small over about "
    "sat jumped sang while the a of and to in is it that"
).split()


def model_dir() -> Path:
    """The built-in tiny LLaVA, written once into the data directory."""
    from loraplex.engine.models.tiny_model import init_tiny

    target = data_dir() / "bench" / "tiny-llava"
    if not (target / "config.json").exists():
        init_tiny(target, seed=0)
    return target


def photo_url(name: str, size: int = 96) -> str:
    """A real photo (``skimage.data``) as a PNG data URL."""
    import base64
    import io

    import numpy as np
    from PIL import Image
    from skimage import data as skdata

    arr = getattr(skdata, name)()
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    buf = io.BytesIO()
    Image.fromarray(arr[..., :3]).resize((size, size)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def words(n: int, gen: torch.Generator) -> str:
    """``n`` random words of a small vocabulary."""
    idx = torch.randint(0, len(WORDS), (n,), generator=gen).tolist()
    return " ".join(WORDS[i] for i in idx)


def zipf(n: int, count: int, gen: torch.Generator, s: float = 1.1) -> list[int]:
    """``count`` draws of ``0 .. n-1`` with Zipf(s) popularity."""
    weights = torch.arange(1, n + 1, dtype=torch.float64).pow(-s)
    return torch.multinomial(weights / weights.sum(), count, True, generator=gen).tolist()


def workload(num: int, tenants: int, digests: list[str], seed: int = 0) -> list:
    """``(tenant, chat messages, adapter digest or None)`` per request."""
    gen = torch.Generator().manual_seed(seed)
    photos = [photo_url(name) for name in PHOTOS]
    systems = [
        [(photos[(3 * t + k) % len(photos)], words(120, gen)) for k in range(3)]
        for t in range(tenants)
    ]
    who = zipf(tenants, num, gen)
    which = zipf(3, num, gen)
    adapter = zipf(3, num, gen)  # 0: base, 1-2: the tenant's adapters
    out = []
    for i in range(num):
        t = who[i]
        image, text = systems[t][which[i]]
        question = words(int(torch.randint(10, 41, (1,), generator=gen)), gen)
        content = [
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "text", "text": f"{text}\n\n{question}"},
        ]
        lora = None if adapter[i] == 0 else digests[(2 * t + adapter[i] - 1) % len(digests)]
        out.append((f"tenant-{t}", [{"role": "user", "content": content}], lora))
    return out


async def prepare(client, requests) -> list:
    """Process each request's messages once: ``(tenant, token ids, images, adapter)``."""
    out = []
    for tenant, messages, lora in requests:
        prompt = await client.process(messages, tenant=tenant)
        out.append((tenant, prompt.prompt_token_ids, prompt.images, lora))
    return out


async def drive(client, requests, concurrency: int, output_tokens: int) -> dict:
    """Run the requests closed-loop; TTFTs, tokens, prompt and cached tokens, seconds."""
    queue = list(enumerate(requests))
    ttfts, stats = [], {"prompt": 0, "cached": 0, "tokens": 0}

    async def worker() -> None:
        while queue:
            i, (tenant, prompt, images, lora) = queue.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
            req = EngineRequest(f"q{i}", list(prompt), params, images=images, lora_digest=lora,
                                cache_salt=tenant)  # fmt: skip
            t0, first, last = time.monotonic(), None, None
            async for out in client.generate(req):
                if first is None and out.outputs and out.outputs[0].num_tokens:
                    first = time.monotonic() - t0
                last = out
            ttfts.append(first or 0.0)
            stats["prompt"] += len(prompt)
            stats["cached"] += last.num_cached_tokens
            stats["tokens"] += last.outputs[0].num_tokens

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {**stats, "seconds": time.monotonic() - t0, "ttfts": sorted(ttfts)}


def run_config(name, path, store_root, adapters, requests, args, prepared: list) -> dict:
    """Start the configuration's replicas, add the adapters, run the workload.

    ``prepared`` holds the processed prompts; the first configuration fills it.
    """
    replicas = 1 if name == "one-big" else args.replicas
    blocks = POOL_BLOCKS * (args.replicas if name == "one-big" else 1)
    config = EngineConfig(model=str(path), num_kv_blocks=blocks, max_loras=2, max_cpu_loras=16,
                          max_lora_rank=16, max_num_seqs=args.concurrency)  # fmt: skip
    policy = {"router": "cache", "round-robin": "round_robin", "least-loaded": "least_loaded"}
    cores = start_cores(config, store_root, in_process=False, replicas=replicas,
                        ray_address="local" if args.ray else None)  # fmt: skip
    client = None
    try:
        # one-big: the whole machine, one pool of N times the blocks
        each = cores.replicas if isinstance(cores, ReplicaRouter) else {"replica-0": cores}
        router = ReplicaRouter(each, RoutingPolicy(block_size=16, policy=policy.get(name, "cache")))
        client = AsyncLLM(router, config)

        async def go():
            if not prepared:
                prepared.extend(await prepare(client, requests))
            for adapter in adapters:
                await client.add_lora(adapter)
            return await drive(client, prepared, args.concurrency, args.tokens)

        result = asyncio.run(go())
        result["adapter_loads"] = client.stats().get("lora_loads", 0)
        result["routed"] = dict(router.num_routed)
    finally:
        (client or cores).shutdown()
    ttfts = result.pop("ttfts")
    result["hit_rate"] = result["cached"] / result["prompt"]
    result["tokens_per_s"] = result["tokens"] / result["seconds"]
    result["ttft_p50_ms"] = 1000 * statistics.median(ttfts)
    result["ttft_p99_ms"] = 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 requests, 4 in flight")
    parser.add_argument("--replicas", type=int, default=2, help="replicas (2)")
    parser.add_argument("--ray", action="store_true", help="replicas as Ray actors")
    parser.add_argument("--requests", type=int, default=None, help="requests (240)")
    parser.add_argument("--concurrency", type=int, default=None, help="in flight (8)")
    parser.add_argument("--tokens", type=int, default=16, help="output tokens each (16)")
    parser.add_argument("--tenants", type=int, default=6, help="tenants (6)")
    args = parser.parse_args()
    args.requests = args.requests or (80 if args.quick else 320)
    args.concurrency = args.concurrency or (4 if args.quick else 8)
    path = model_dir()
    cfg = json.loads((path / "config.json").read_text())["text_config"]
    root = Path(data_dir()) / "bench" / "scale"
    store_root = root / "store"
    store = AdapterStore(store_root)
    prefix = "base_model.model.model.language_model"
    dirs = write_adapters(root / "adapters-llava", cfg, 2 * args.tenants, prefix=prefix)
    from loraplex.adapters.limits import AdapterLimits
    from loraplex.engine.lora.targets import served_targets
    from loraplex.engine.models.loader import load_model

    model, hf_config = load_model(str(path), torch.float32, torch.device("cpu"))
    limits = AdapterLimits(targets=served_targets(model, hf_config), max_rank=16)
    adapters = [store.put_dir(d, limits=limits) for d in dirs]
    requests = workload(args.requests, args.tenants, [a.digest for a in adapters])
    results: dict[str, dict] = {}
    prepared: list = []
    for name in ("one-big", "router", "round-robin", "least-loaded"):
        results[name] = run_config(name, path, store_root, adapters, requests, args, prepared)
    big = results["one-big"]["hit_rate"]
    print(f"{args.requests} requests, {args.tenants} tenants x 3 system prompts (photo + text) "
          f"x 2 adapters; "
          f"{args.replicas} replicas of {POOL_BLOCKS} blocks vs one of "
          f"{POOL_BLOCKS * args.replicas}; {args.concurrency} in flight")  # fmt: skip
    print(f"{'config':<14}{'hit rate':>9}{'x big':>7}{'loads':>7}{'tok/s':>8}"
          f"{'TTFT p50':>10}{'p99 ms':>8}  routed")  # fmt: skip
    for name, r in results.items():
        print(f"{name:<14}{r['hit_rate']:>9.3f}{r['hit_rate'] / big:>7.2f}"
              f"{r['adapter_loads']:>7}{r['tokens_per_s']:>8.1f}{r['ttft_p50_ms']:>10.0f}"
              f"{r['ttft_p99_ms']:>8.0f}  {r['routed']}")  # fmt: skip
    print("target: router hit rate >= 0.95 x one-big's, clearly above round-robin/least-loaded")
    print(json.dumps({"bench": "scale", "replicas": args.replicas, "requests": args.requests,
                      "results": results}))  # fmt: skip


if __name__ == "__main__":
    main()
