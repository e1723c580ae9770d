"""bench.hostile's own parts against a real ``loraplex serve``: every hostile request of the
catalog gets its 4xx (never a 500) and the engine still serves afterwards; the latency and
schema-attack parts produce their figures (and the schema attacks kill no engine core)."""

import asyncio

import pytest

from bench.hostile import attacks, latency, schemas
from bench.hostile.__main__ import BIG_CUSTOMER, MODEL
from bench.hostile.live import ADMIN_KEY, LiveServer

pytestmark = pytest.mark.slow

EXPECTED = {
    "top_k 2**63": 400,
    "seed 2**64": 400,
    "logprobs, no top_logprobs": 200,
    "top_logprobs 0": 200,
    "top_logprobs 0, n 3, stream": 200,
    "max_tokens 2**63": 400,
    "prompt + max_tokens past the model": 400,
    "30 MiB of text": 400,
    "a message per token": 400,
    "eight 32768x1 PNGs": 400,
    "PNG header claiming 10^10 pixels": 400,
    "nine images": 400,
    "JSON nested 5000 deep": 400,
    "invalid UTF-8": 400,
    "CESU-8 surrogate": 400,
    "NUL in model": 404,
    "stop string of 1 MB": 400,
    "remote image URL": 400,
    "admin route, tenant key": 403,
    "admin limits 2**63": 400,
    "token id 2**64 in a completions prompt": 400,
    "unknown role": 400,
    "content null on a user message": 400,
    "tool call arguments that are not JSON": 400,
    "1,050-link $defs chain (SIGSEGV before)": 400,
    'schema {"$ref": "#"} (allows no token)': 400,
    "guided_regex a{1000000}": 400,
    "/metrics with a tenant key": 403,
}


def test_the_hostile_catalog_gets_no_500_and_the_latency_parts_run(llava_dir, tmp_path):
    flags = ["--served-model-name", MODEL, "--num-kv-blocks", "512"]
    with LiveServer(tmp_path / "data", llava_dir, flags) as server:
        hostile = server.create_tenant("hostile")
        bystander = server.create_tenant("bystander")
        server.set_limits(hostile["id"], **BIG_CUSTOMER)
        result = attacks.run(server.base_url, hostile["api_key"], ADMIN_KEY, 4096)
        assert result["status_500_count"] == 0 and result["engine_survived"], result
        for name, status in EXPECTED.items():
            assert result["statuses"][name] == status, (name, result["statuses"][name])
        host, port = "127.0.0.1", server.port
        bodies = latency.expensive_bodies("word " * 200, max_images=2)
        load = asyncio.run(
            latency.bystander_under_expensive_load(
                host,
                port,
                bystander["api_key"],
                hostile["api_key"],
                bodies,
                samples=2,
                workers=2,
                warmup=0.2,
            )
        )
        assert load["idle"]["n"] == 2 and load["loaded"]["n"] == 2
        assert load["bystander_latency_ratio"] > 0
        assert set(load["hostile_statuses"]) <= {200}
        fair = asyncio.run(
            latency.ttft_under_many_streams(
                host, port, bystander["api_key"], hostile["api_key"], streams=10, samples=2
            )
        )
        assert fair["loaded"]["n"] == 2 and fair["fair_share_ttft_ratio"] > 0
        figures = schemas.run(server, bystander["api_key"], hostile["api_key"], quick=True)
        assert figures["schema_engine_deaths"] == 0 and figures["schema_engine_healthy"]
        assert figures["schema_status_500_count"] == 0
        assert figures["schema_bystander_decode_ratio"] > 0
        assert figures["schema_served_heavy"] > 0  # the costly but bounded schemas are served
        assert server.alive
