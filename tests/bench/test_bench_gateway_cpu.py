"""bench.gateway_cpu drives the real app in-process: answers are checked, figures are sane."""

import asyncio
import json

import pytest

from bench.gateway_cpu import InProcessClient, build, chat_body, measure

pytestmark = pytest.mark.slow


def test_in_process_client_gets_real_answers_and_refusals(tmp_path):
    app, _ = build(str(tmp_path))

    async def main():
        client = InProcessClient(app)
        await client.start()
        try:
            missing = await client.request("POST", "/v1/chat/completions", "lpx-nope", b"{}")
            status, created = await client.request(
                "POST", "/admin/tenants", "lpx-admin-bench-" + "0" * 32, b'{"name": "t"}'
            )
            key = json.loads(created)["api_key"]
            streamed = await client.request("POST", "/v1/chat/completions", key, chat_body(True))
            plain = await client.request("POST", "/v1/chat/completions", key, chat_body(False))
            return missing, status, streamed, plain
        finally:
            await client.stop()

    missing, status, streamed, plain = asyncio.run(main())
    assert missing[0] == 401 and status == 201
    assert streamed[0] == 200 and streamed[1].endswith(b"data: [DONE]\n\n")
    assert plain[0] == 200 and b'"completion_tokens":16' in plain[1]


def test_measure_reports_cpu_per_request_above_the_direct_engine(tmp_path):
    app, engine = build(str(tmp_path))
    results = asyncio.run(measure(app, engine, n=20, rounds=1))
    assert set(results) == {"direct", "stream", "json"}
    for figures in results.values():
        assert figures["loop_us"] > 0 and figures["process_us"] >= figures["loop_us"] * 0.5
    assert results["stream"]["loop_us"] > results["direct"]["loop_us"]
    assert engine.finished >= 2 * 20 and engine.in_flight == 0


@pytest.fixture(autouse=True)
def _unfreeze():
    import gc

    yield
    gc.unfreeze()  # measure() freezes the heap as serve does; leave other tests as they were
