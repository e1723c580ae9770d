"""The engine core in its own process (``serve``'s default; issue 15 item 2): the same tokens as
the in-process engine, and a core killed mid-request is noticed at once, fails its requests with
503 and ``aborted`` usage rows, fails ``/health`` while it restarts, then serves again without a
gateway restart."""

import asyncio
import os
import signal
import time

import httpx
import pytest

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.structured_output.grammar import StructuredOutputError, StructuredOutputSpec
from loraplex.gateway.server.build import start_engine
from tests.gateway.chat_support import (
    BackgroundStream,
    long_stream_body,
    usage_events,
    wait_for,
)
from tests.gateway.live import LiveGateway

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def proc(tiny_text_dir, tmp_path_factory):
    config = EngineConfig(model=str(tiny_text_dir), served_model_name="tiny", num_kv_blocks=128)
    client = start_engine(config, tmp_path_factory.mktemp("store"), in_process=False)
    yield client
    client.shutdown()


def test_tokenize_and_detokenize_use_the_gateway_side_tokenizer(proc, tiny_text_dir):
    local = LLM(EngineConfig(model=str(tiny_text_dir), num_kv_blocks=16))
    text = "A story about a river"
    ids = asyncio.run(proc.tokenize(text))
    assert ids == local.engine.tokenizer(text).input_ids
    assert asyncio.run(proc.detokenize(ids)).endswith(text)
    with pytest.raises(ValueError):
        asyncio.run(proc.detokenize([10**9]))


def collect(client, request):
    async def run():
        return [out async for out in client.generate(request)]

    return asyncio.run(run())


def test_the_same_tokens_as_in_process(proc, tiny_text_dir):
    local = LLM(EngineConfig(model=str(tiny_text_dir), num_kv_blocks=128))
    prompt = local.engine.tokenizer("A story about a river and a bridge").input_ids
    cases = {
        "greedy": SamplingParams(temperature=0, max_tokens=12),
        "seeded": SamplingParams(temperature=1.0, seed=3, max_tokens=12, logprobs=2),
        "forks": SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=8),
        "stop": SamplingParams(temperature=0, max_tokens=30, stop=["e"]),  # client side
        "json": SamplingParams(
            temperature=1.0,
            seed=2,
            max_tokens=40,
            structured_output=StructuredOutputSpec("regex", "(yes|no)-[0-9]{3}"),
        ),
        "processors": SamplingParams(  # logit_bias's int keys cross the wire
            temperature=0.7,
            seed=9,
            max_tokens=10,
            logit_bias={7: 3.0},
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            min_tokens=4,
            stop_token_ids=[9],
        ),
    }
    for name, params in cases.items():
        want = local.generate([EngineRequest(name, list(prompt), params)])[0]
        outs = collect(proc, EngineRequest(name, list(prompt), params))
        assert outs[-1].finished
        for i, choice in enumerate(want.outputs):
            got_ids = [t for o in outs for c in o.outputs if c.index == i for t in c.token_ids]
            got_text = "".join(c.text for o in outs for c in o.outputs if c.index == i)
            assert got_ids == choice.token_ids, name
            assert got_text == choice.text, name
    with pytest.raises(StructuredOutputError):
        collect(
            proc,
            EngineRequest(
                "bad",
                list(prompt),
                SamplingParams(structured_output=StructuredOutputSpec("regex", "[a-")),
            ),
        )
    with pytest.raises(ValueError, match="prompt token ids must be in"):
        collect(proc, EngineRequest("oov", [10**7], SamplingParams()))
    assert wait_for(lambda: proc.stats()["kv_blocks_in_use"] == 0, timeout=5)


def test_a_killed_core_fails_its_requests_and_comes_back(proc, tmp_path):
    with LiveGateway(proc, tmp_path / "data") as live:
        key = live.create_tenant("acme")["api_key"]
        auth = {"Authorization": f"Bearer {key}"}
        body = long_stream_body("tiny")
        stream = BackgroundStream(live, body, auth).start()
        assert stream.first_chunk.wait(30)
        old_pid = proc.core.pid
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        stream.join(30)
        assert stream.ended - killed < 1.0  # noticed at once, not after a timeout
        lines = [line for line in stream.lines if line]
        assert '"engine_unavailable"' in lines[-2] and lines[-1] == "data: [DONE]"
        with httpx.Client(base_url=live.base_url, timeout=60) as c:
            assert c.get("/health").status_code == 503  # restarting (0.5 s back-off + load)
            plain = {**body, "stream": False, "max_tokens": 4}
            assert c.post("/v1/chat/completions", json=plain, headers=auth).status_code == 503
            assert wait_for(lambda: c.get("/health").status_code == 200, timeout=120)
            assert proc.core.pid != old_pid and proc.core.restarts >= 1
            r = c.post("/v1/chat/completions", json=plain, headers=auth)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        rows = usage_events(live, key)
        assert [row.status for row in rows][:1] == ["aborted"]
        assert rows[0].error_type == "engine_unavailable" and rows[-1].status == "ok"


def test_a_core_whose_gateway_is_killed_exits(tiny_text_dir, tmp_path):
    """A SIGKILLed gateway leaves no orphan core (nor its grammar sandbox) behind."""
    import subprocess
    import sys

    script = (
        "import sys, time\n"
        "from loraplex.engine.config import EngineConfig\n"
        "from loraplex.gateway.server.build import start_engine\n"
        f"c = start_engine(EngineConfig(model={str(tiny_text_dir)!r}, num_kv_blocks=32),"
        f" {str(tmp_path / 'store')!r}, in_process=False)\n"
        "print(c.core.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    gateway = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(gateway.stdout.readline())
        os.kill(core_pid, 0)  # running
        gateway.kill()
        gateway.wait()

        def gone():
            try:
                os.kill(core_pid, 0)
            except ProcessLookupError:
                return True
            return False

        assert wait_for(gone, timeout=10)
    finally:
        gateway.kill()
