"""The front over fake core clients (issue 28 item 1): the front knows nothing of what is below
the ``EngineCoreClient`` interface; a router over two cores sends each request to one, forwards
stop-string finishes and aborts to that one, fails only a dead core's requests, and gives its
queued tokens back however a request ends."""

import asyncio

import pytest

from loraplex.adapters.base_model import ModelTargets
from loraplex.adapters.limits import AdapterLimits
from loraplex.engine.client.core_client import CoreInfo, EngineCoreClient
from loraplex.engine.client.front import AsyncLLM
from loraplex.engine.client.replicas import ReplicaRouter
from loraplex.engine.client.router import RoutingPolicy
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import EngineDeadError
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.scheduling.output import EngineCoreOutput


class FakeCore(EngineCoreClient):
    """Records what it is told; the test plays the core through its sink."""

    def __init__(self) -> None:
        self.info = CoreInfo(
            max_model_len=256,
            adapter_limits=AdapterLimits(ModelTargets.uniform("Fake", "model.layers", [], 1), 8),
            image_token_id=None,
            num_image_tokens=0,
            num_parameters=1,
            dtype="float32",
            device="cpu",
            kv_pool="fake",
            pid=0,
            vocab_size=0,
        )
        self.sink = None
        self.added, self.aborted, self.finished, self.released = [], [], [], []
        self.running = True

    def set_sink(self, sink):
        self.sink = sink

    def add_request(self, request, block_hashes=()):
        if not self.running:
            raise EngineDeadError("down")
        self.added.append(request.request_id)

    def abort(self, request_id):
        self.aborted.append(request_id)

    def finish_requests(self, finishes):
        self.finished.extend(finishes)

    def release(self, request_id):
        self.released.append(request_id)

    async def add_lora(self, adapter):
        return None

    async def remove_lora(self, digest):
        return True

    def stats(self):
        return {"requests_running": len(self.added)}

    def drain_kv_events(self):
        return []

    @property
    def is_running(self):
        return self.running

    def shutdown(self, timeout=10.0):
        self.running = False


@pytest.fixture
def front(tiny_text_dir):
    cores = {"a": FakeCore(), "b": FakeCore()}
    router = ReplicaRouter(cores, RoutingPolicy(policy="round_robin"))
    llm = AsyncLLM(router, EngineConfig(model=tiny_text_dir), workers=2)
    yield llm, router, cores
    llm.shutdown()


def test_a_router_of_fake_cores_behind_the_front(front):
    llm, router, cores = front
    tok = llm.tokenizer
    hello = tok.encode(" hello", add_special_tokens=False)
    stop = SamplingParams(max_tokens=8, stop=["hello"])

    async def scenario():
        prompt = await llm.process([{"role": "user", "content": "hi"}])
        ids = list(prompt.prompt_token_ids)
        one = llm.generate(EngineRequest("r1", ids, stop))
        two = llm.generate(EngineRequest("r2", ids, SamplingParams(max_tokens=8)))
        first = asyncio.ensure_future(one.__anext__())
        second = asyncio.ensure_future(two.__anext__())
        await asyncio.sleep(0.05)
        assert cores["a"].added == ["r1"] and cores["b"].added == ["r2"]
        assert router.router.views["a"].outstanding_tokens > 0
        # a stop string found by the front goes back to r1's core only
        llm.on_outputs([EngineCoreOutput("r1", 0, hello)])
        out = await first
        assert out.finished and out.outputs[0].finish_reason == "stop"
        assert [f.request_id for f in cores["a"].finished] == ["r1"] and not cores["b"].finished
        with pytest.raises(StopAsyncIteration):
            await one.__anext__()
        assert cores["a"].released == ["r1"] and router.router.views["a"].outstanding_tokens == 0
        # core b dies: only its request fails, with EngineDeadError
        cores["b"].sink.on_dead(EngineDeadError("core b died"))
        with pytest.raises(EngineDeadError):
            await second
        assert router.router.views["b"].outstanding_tokens == 0
        # a consumer that leaves aborts its request on its core
        three = llm.generate(EngineRequest("r3", ids, SamplingParams(max_tokens=8)))
        nxt = asyncio.ensure_future(three.__anext__())
        await asyncio.sleep(0.05)
        home = "a" if "r3" in cores["a"].added else "b"
        nxt.cancel()
        await asyncio.sleep(0)
        await three.aclose()
        assert cores[home].aborted == ["r3"] and cores[home].released[-1] == "r3"

    asyncio.run(scenario())
    assert llm.describe()["replicas"] == 2
    assert llm.stats()["routed"] == {"a": 2, "b": 1}
    assert not llm.output_processor.requests
