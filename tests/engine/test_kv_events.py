"""KV events from a running engine (issue 18 item 2): a router view built only from them holds
exactly the engine's cached block hashes and resident adapters, through evictions, adapter
slot churn and preemption; and a request's hashes computed outside the engine match them."""

from loraplex.engine.client.llm import LLM
from loraplex.engine.client.replica_view import ReplicaView
from loraplex.engine.client.router import Router
from loraplex.engine.config import EngineConfig
from loraplex.engine.sampling.params import SamplingParams

from .conftest import long_text, user
from .test_lora_parity import adapter_dirs, run  # noqa: F401, F811 - fixture and helper


def mirror(llm, view):
    view.apply(llm.engine.core.drain_kv_events())
    assert view.hashes == set(llm.engine.kv.pool.cached)
    assert view.adapters == set(llm.engine.lora_manager.device_digests)


def test_a_view_from_events_mirrors_cache_and_adapter_slots(tiny_llava_dir, adapter_dirs):  # noqa: F811
    # 2 device slots for 3 adapters, and a pool small enough to evict and preempt.
    llm = LLM(
        EngineConfig(
            model=tiny_llava_dir,
            max_loras=2,
            max_cpu_loras=8,
            max_lora_rank=16,
            num_kv_blocks=20,
            max_num_batched_tokens=96,
            enable_kv_events=True,
        )
    )
    view = ReplicaView("r0")
    for tag in ("a", "b"):
        run(llm, adapter_dirs, tag)
        mirror(llm, view)
    engine = llm.engine
    assert engine.kv.pool.num_evictions > 0 and engine.lora_manager.num_loads > 3
    assert llm.engine.kv.reset_prefix_cache()
    mirror(llm, view)
    assert view.hashes == set()


def test_hashes_computed_outside_the_engine_find_its_blocks(tiny_text_dir):
    llm = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=128, enable_kv_events=True))
    router = Router(["r0", "r1"])
    prompt = long_text(120, seed=40)
    first = llm.make_request(user(prompt), SamplingParams(max_tokens=4), cache_salt="tenant-a")
    llm.generate([first])
    router.views["r0"].apply(llm.engine.core.drain_kv_events())
    bs = llm.engine.kv.block_size
    again = llm.make_request(user(prompt), SamplingParams(max_tokens=4), cache_salt="tenant-a")
    hashes = again.block_hasher(bs).block_hashes
    assert router.views["r0"].leading_hits(hashes) == len(hashes) > 4
    assert router.choose(hashes) == "r0"
    other = llm.make_request(user(prompt), SamplingParams(max_tokens=4), cache_salt="tenant-b")
    assert router.views["r0"].leading_hits(other.block_hasher(bs).block_hashes) == 0
    off = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=16))
    assert off.engine.core.drain_kv_events() == []  # off unless asked for
