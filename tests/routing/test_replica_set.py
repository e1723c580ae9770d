"""Two in-process engine cores behind one ReplicaRouter (under one front): requests sharing a
prefix go where it is cached, tenants' salts keep their blocks apart, outputs equal one
engine's, and a stopped replica leaves the routing table while the other serves."""

import asyncio
import re

import pytest

from loraplex.engine.client.front import AsyncLLM
from loraplex.engine.client.replicas import ReplicaRouter
from loraplex.engine.client.router import RoutingPolicy
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import EngineDeadError
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.gateway.server.build import start_cores, start_engine
from tests.media import long_text

pytestmark = pytest.mark.slow


@pytest.fixture
def replica_set(tiny_text_dir, tmp_path):
    config = EngineConfig(model=str(tiny_text_dir), num_kv_blocks=128, enable_kv_events=True)
    replicas = {f"r{i}": start_cores(config, tmp_path / "store") for i in range(2)}
    client = AsyncLLM(ReplicaRouter(replicas, RoutingPolicy(block_size=config.block_size)), config)
    yield client
    client.shutdown()


def collect(client, request):
    async def run():
        return [out async for out in client.generate(request)]

    return asyncio.run(run())


def request(client, rid, text, salt, max_tokens=6):
    prompt = asyncio.run(client.process([{"role": "user", "content": text}]))
    return EngineRequest(
        rid,
        list(prompt.prompt_token_ids),
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        cache_salt=salt,
    )


def test_shared_prefixes_follow_their_blocks_and_tenants_stay_apart(replica_set, tiny_text_dir):
    texts = [long_text(100, seed=50 + i) for i in range(4)]
    firsts = [request(replica_set, f"a{i}", text, "tenant-a") for i, text in enumerate(texts)]

    async def together():  # in flight at once: spread by queued tokens
        async def one(req):
            return [out async for out in replica_set.generate(req)]

        return await asyncio.gather(*(one(r) for r in firsts))

    asyncio.run(together())
    assert replica_set.core.num_routed == {"r0": 2, "r1": 2}
    replica_set.core.refresh()
    homes = {
        name: view.leading_hits(firsts[0].block_hasher(16).block_hashes)
        for name, view in replica_set.core.router.views.items()
    }
    assert sorted(homes.values())[0] == 0 < sorted(homes.values())[1]  # one replica holds it
    for i, text in enumerate(texts):  # one at a time: each goes where its blocks are
        again = request(replica_set, f"b{i}", text, "tenant-a")
        home = replica_set.core.route(again.block_hasher(16).block_hashes)
        assert replica_set.core.router.views[home].leading_hits(again.block_hasher(16).block_hashes)
        outs = collect(replica_set, again)
        assert outs[-1].num_cached_tokens > 0, i
    other = request(replica_set, "c0", texts[0], "tenant-b")  # the same text, another tenant
    outs = collect(replica_set, other)
    assert outs[-1].num_cached_tokens == 0
    stats = replica_set.stats()
    assert stats["replicas"] == stats["replicas_running"] == 2
    assert stats["kv_blocks_total"] == 256


def test_outputs_equal_one_engine_and_a_stopped_replica_is_skipped(
    replica_set, tiny_text_dir, tmp_path
):
    config = EngineConfig(model=str(tiny_text_dir), num_kv_blocks=128)
    single = start_engine(config, tmp_path / "single-store")
    try:
        for i in range(4):
            text = long_text(30 + 10 * i, seed=60 + i)
            want = collect(single, request(single, f"s{i}", text, "t"))[-1].outputs[0].token_ids
            got = collect(replica_set, request(replica_set, f"s{i}", text, "t"))
            assert got[-1].outputs[0].token_ids == want
    finally:
        single.shutdown()
    replica_set.core.replicas["r0"].shutdown()  # its engine dies; the gateway side stays
    probes = [request(replica_set, f"d{i}", "hi", "t") for i in range(3)]
    routed = [replica_set.core.route(r.block_hasher(16).block_hashes) for r in probes]
    assert routed == ["r1"] * 3 and not replica_set.core.router.views["r0"].healthy
    assert collect(replica_set, request(replica_set, "d9", "hi", "t"))[-1].finished
    replica_set.core.replicas["r1"].shutdown()
    assert not replica_set.is_running
    with pytest.raises(EngineDeadError):
        collect(replica_set, request(replica_set, "e0", "hi", "t"))


def test_a_killed_replica_fails_only_its_requests_through_the_gateway(tiny_text_dir, tmp_path):
    """Two core processes behind the gateway: SIGKILL the one serving a stream. The stream
    ends at once with ``engine_unavailable`` and an ``aborted`` usage row; /health stays 200
    and new requests are served by the other replica meanwhile; the killed one comes back."""
    import os
    import signal
    import time

    import httpx

    from tests.gateway.chat_support import (
        BackgroundStream,
        long_stream_body,
        usage_events,
        wait_for,
    )
    from tests.gateway.live import NO_LIMITS, LiveGateway

    config = EngineConfig(model=str(tiny_text_dir), served_model_name="tiny", num_kv_blocks=128)
    client = start_engine(config, tmp_path / "store", in_process=False, replicas=2)
    try:
        with LiveGateway(client, tmp_path / "data", **NO_LIMITS) as live:
            key = live.create_tenant("acme")["api_key"]
            auth = {"Authorization": f"Bearer {key}"}
            body = long_stream_body("tiny", ignore_eos=True)
            stream = BackgroundStream(live, body, auth).start()
            assert stream.first_chunk.wait(30)
            busy = next(n for n, r in client.core.replicas.items() if r.stats()["requests_running"])
            victim = client.core.replicas[busy]
            old_pid, killed = victim.pid, time.monotonic()
            os.kill(old_pid, signal.SIGKILL)
            stream.join(30)
            assert stream.ended - killed < 1.0
            lines = [line for line in stream.lines if line]
            assert '"engine_unavailable"' in lines[-2] and lines[-1] == "data: [DONE]"
            plain = {**body, "stream": False, "max_tokens": 4}
            with httpx.Client(base_url=live.base_url, timeout=60) as c:
                assert c.get("/health").status_code == 200  # the other replica serves
                for _ in range(3):
                    r = c.post("/v1/chat/completions", json=plain, headers=auth)
                    assert r.status_code == 200, r.text
                assert wait_for(lambda: victim.is_running and victim.pid != old_pid, timeout=120)
                text = live.metrics()
            assert "\nloraplex_replicas 2.0\n" in text
            assert "\nloraplex_replicas_running 2.0\n" in text
            routed = {
                name: float(v)
                for name, v in re.findall(
                    r'^loraplex_router_requests_total\{replica="([^"]+)"\} (\S+)$', text, re.M
                )
            }
            assert sum(routed.values()) == 4 and routed[busy] >= 1
            rows = usage_events(live, key)
            assert [row.status for row in rows] == ["aborted", "ok", "ok", "ok"]
            assert rows[0].error_type == "engine_unavailable"
            assert client.core.num_routed[busy] >= 1
    finally:
        client.shutdown()


def test_process_replicas_on_cuda_get_one_visible_gpu_each(monkeypatch):
    from loraplex.engine.core import process as core_proc
    from loraplex.engine.core.launch import run_core_with_env
    from loraplex.gateway.server.build import _replica_env

    cuda = EngineConfig(model="m", device="cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert [_replica_env(cuda, i) for i in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": "3"},
        {"CUDA_VISIBLE_DEVICES": "5"},
        {"CUDA_VISIBLE_DEVICES": "3"},
    ]
    assert _replica_env(EngineConfig(model="m"), 0) == {}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="no CUDA device"):
        _replica_env(cuda, 0)
    seen = {}

    def fake_run_core(*args):
        import os

        seen["env"], seen["args"] = os.environ["CUDA_VISIBLE_DEVICES"], args

    monkeypatch.setattr(core_proc, "run_core", fake_run_core)
    run_core_with_env({"CUDA_VISIBLE_DEVICES": "5"}, "config", None, "in", "out")
    assert seen == {"env": "5", "args": ("config", None, "in", "out")}


def test_a_frozen_replica_leaves_the_table_within_a_second_and_is_replaced(tiny_text_dir, tmp_path):
    """SIGSTOP the core process serving a stream (alive, but answering nothing): within 1 s it
    is out of the routing table and the other replica serves new requests; after the config's
    ``dead_timeout_s`` its stream ends with ``engine_unavailable`` and an ``aborted`` usage row,
    and a new core takes its place. A core stopped for less than that serves on."""
    import os
    import signal
    import time

    import httpx

    from tests.gateway.chat_support import (
        BackgroundStream,
        long_stream_body,
        usage_events,
        wait_for,
    )
    from tests.gateway.live import NO_LIMITS, LiveGateway

    config = EngineConfig(
        model=str(tiny_text_dir),
        served_model_name="tiny",
        num_kv_blocks=128,
        dead_timeout_s=3.0,
    )
    client = start_engine(config, tmp_path / "store", in_process=False, replicas=2)
    try:
        with LiveGateway(client, tmp_path / "data", **NO_LIMITS) as live:
            key = live.create_tenant("acme")["api_key"]
            auth = {"Authorization": f"Bearer {key}"}
            plain = {**long_stream_body("tiny"), "stream": False, "max_tokens": 4}
            # A short freeze (under dead_timeout_s): out of the table, then back, same process.
            replica = client.core.replicas["replica-1"]
            pid = replica.pid
            os.kill(pid, signal.SIGSTOP)
            try:
                assert wait_for(lambda: not replica.is_running, timeout=1.5)
                assert replica.recovering
            finally:
                os.kill(pid, signal.SIGCONT)
            assert wait_for(lambda: replica.is_running, timeout=5)
            assert replica.pid == pid and replica.restarts == 0

            body = long_stream_body("tiny", ignore_eos=True)
            stream = BackgroundStream(live, body, auth).start()
            assert stream.first_chunk.wait(30)
            busy = next(n for n, r in client.core.replicas.items() if r.stats()["requests_running"])
            victim = client.core.replicas[busy]
            old_pid = victim.pid
            os.kill(old_pid, signal.SIGSTOP)
            frozen = time.monotonic()
            assert wait_for(lambda: not victim.is_running, timeout=1.0)
            assert time.monotonic() - frozen < 1.0 + 0.2  # the poll's own step
            routed_before = dict(client.core.num_routed)
            with httpx.Client(base_url=live.base_url, timeout=60) as c:
                assert c.get("/health").status_code == 200  # the other replica serves
                for _ in range(2):
                    r = c.post("/v1/chat/completions", json=plain, headers=auth)
                    assert r.status_code == 200, r.text
                assert client.core.num_routed[busy] == routed_before[busy]  # none went to it
                stream.join(30)
                waited = stream.ended - frozen
                assert config.dead_timeout_s - 0.5 < waited < config.dead_timeout_s + 2.0
                lines = [line for line in stream.lines if line]
                assert '"engine_unavailable"' in lines[-2] and lines[-1] == "data: [DONE]"
                assert wait_for(lambda: victim.is_running and victim.pid != old_pid, timeout=120)
                r = c.post("/v1/chat/completions", json=plain, headers=auth)
                assert r.status_code == 200, r.text
            rows = usage_events(live, key)
            assert [row.status for row in rows] == ["ok", "ok", "aborted", "ok"]
            assert rows[2].error_type == "engine_unavailable"
    finally:
        client.shutdown()


def test_a_core_is_hung_when_silent_or_stuck_in_one_step(tiny_text_dir):
    """The reader's verdict: silent for ``dead_timeout_s``, or one step older than
    ``step_timeout_s`` (heartbeats still coming), and the core is killed."""
    import time
    from types import SimpleNamespace

    from loraplex.engine.client.process import ProcessCoreClient

    config = EngineConfig(model=str(tiny_text_dir), dead_timeout_s=2.0, step_timeout_s=30.0)
    core = ProcessCoreClient(config, None)
    core._proc = SimpleNamespace(pid=1)
    core._running = True
    core._last_heard = time.monotonic()
    assert not core._hung() and core.is_running
    core._last_heard = time.monotonic() - 1.5  # past unresponsive_timeout_s only
    assert not core._hung() and not core.is_running and core.recovering
    core._last_heard = time.monotonic() - 2.5
    assert core._hung()
    core._last_heard, core._step_s = time.monotonic(), 31.0
    assert core._hung() and core.is_running


def test_serve_flags_set_the_core_timeouts(tmp_path):
    from loraplex.gateway.cli import build_parser
    from loraplex.gateway.commands.serve import serve_engine_config

    def config(*flags):
        args = build_parser().parse_args(["serve", "--data-dir", str(tmp_path), *flags])
        return serve_engine_config(args, "m")

    default = config()
    assert (default.unresponsive_timeout_s, default.dead_timeout_s) == (1.0, 10.0)
    assert default.step_timeout_s == 600.0
    c = config("--engine-dead-timeout", "4", "--engine-step-timeout", "30")
    assert (c.dead_timeout_s, c.step_timeout_s) == (4.0, 30.0)
    assert config("--no-engine-process").dead_timeout_s == 10.0  # defaults: nothing asked
    for bad in (
        ["--engine-dead-timeout", "0.5"],
        ["--engine-step-timeout", "0"],
        ["--no-engine-process", "--engine-dead-timeout", "5"],
    ):
        with pytest.raises(ValueError, match="--engine-"):
            config(*bad)


def test_serve_flags_for_several_gateways(tmp_path, monkeypatch):
    from loraplex.gateway.cli import build_parser
    from loraplex.gateway.commands.serve import gateway_config_from_args

    def config(*flags):
        args = build_parser().parse_args(["serve", "--data-dir", str(tmp_path), *flags])
        return gateway_config_from_args(args, "m")

    default = config()
    assert default.rate_limit_url is None and default.store_location == str(tmp_path / "adapters")
    c = config("--rate-limit-url", "redis://r:6379/0", "--adapter-store", "s3://bucket/a")
    assert (c.rate_limit_url, c.store_location) == ("redis://r:6379/0", "s3://bucket/a")
    assert config("--adapter-store", str(tmp_path / "s")).store_location == str(tmp_path / "s")
    monkeypatch.setenv("LORAPLEX_RATE_LIMIT_URL", "rediss://r/1")
    assert config().rate_limit_url == "rediss://r/1"
    with pytest.raises(ValueError, match="--rate-limit-url"):
        config("--rate-limit-url", "http://r:6379")
