"""Engine replicas as Ray actors on a local Ray instance (issue 18 item 1): the same tokens as
one engine, routing by cached blocks, and a killed replica leaves the routing table at once,
its requests end with EngineDeadError (the gateway's 503), and a new actor takes its place."""

import asyncio
import time

import pytest

from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import EngineDeadError
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.gateway.server.build import start_engine
from tests.media import long_text

pytestmark = pytest.mark.service

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_set(tiny_text_dir, tmp_path_factory):
    config = EngineConfig(model=str(tiny_text_dir), num_kv_blocks=128)
    client = start_engine(
        config, tmp_path_factory.mktemp("store"), in_process=False, replicas=2, ray_address="local"
    )
    yield client
    client.shutdown()
    ray.shutdown()


def collect(client, request):
    async def run():
        return [out async for out in client.generate(request)]

    return asyncio.run(run())


def route(client, request):
    """The replica the front's router picks for ``request``."""
    return client.core.route(request.block_hasher(16).block_hashes, request.lora_digest)


def make(client, rid, text, max_tokens=8):
    prompt = asyncio.run(client.process([{"role": "user", "content": text}]))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest(rid, list(prompt.prompt_token_ids), params, cache_salt="t")


def test_ray_replicas_serve_route_and_replace_a_dead_one(ray_set, tiny_text_dir, tmp_path):
    assert ray_set.stats()["replicas_running"] == 2
    text = long_text(80, seed=70)
    single = start_engine(EngineConfig(model=str(tiny_text_dir), num_kv_blocks=128), tmp_path)
    try:
        want = collect(single, make(single, "w", text))[-1].outputs[0].token_ids
    finally:
        single.shutdown()
    first = make(ray_set, "a", text)
    home = route(ray_set, first)
    assert collect(ray_set, first)[-1].outputs[0].token_ids == want
    again = make(ray_set, "b", text)
    assert route(ray_set, again) == home  # its blocks are there
    assert collect(ray_set, again)[-1].num_cached_tokens > 0

    victim = ray_set.core.replicas[home]
    long_request = make(ray_set, "c", text, max_tokens=400)

    async def kill_mid_stream():
        seen = 0
        with pytest.raises(EngineDeadError):
            async for _ in ray_set.generate(long_request):
                seen += 1
                if seen == 2:
                    ray.kill(victim._proc.actor, no_restart=True)
        return time.monotonic()

    assert route(ray_set, make(ray_set, "probe", text)) == home
    asyncio.run(kill_mid_stream())
    t0 = time.monotonic()
    while route(ray_set, make(ray_set, "x", "hi")) == home and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert time.monotonic() - t0 < 1.0  # out of the routing table within a second
    other = next(name for name in ray_set.core.replicas if name != home)
    assert collect(ray_set, make(ray_set, "d", text))[-1].finished
    deadline = time.monotonic() + 120
    while not ray_set.core.replicas[home].is_running and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_set.core.replicas[home].is_running  # a new actor took its place
    ray_set.core.refresh()
    assert ray_set.core.router.views[home].healthy and ray_set.core.router.views[other].healthy
