"""Adapters in object storage, end to end (issue 18): two gateways over one database and one
S3 bucket (moto's server), two engine replicas in their own processes reading the bucket.
An adapter uploaded through one gateway is served through the other, by either replica, with
the tokens the session engine gives from its local store; the cores keep the download in
their local cache; deleting it removes it from the bucket."""

import asyncio

import pytest

from loraplex.engine.config import EngineConfig
from loraplex.gateway.server.build import start_engine
from tests.gateway.chat_support import engine_direct, image_part, user
from tests.gateway.conftest import adapter_store_dir
from tests.gateway.live import NO_LIMITS, LiveGateway
from tests.gateway.test_adapters_api import upload_dir
from tests.media import data_url, photo
from tests.s3_server import s3_server

pytestmark = pytest.mark.service


@pytest.fixture
def bucket(monkeypatch):
    with s3_server(monkeypatch) as url:
        yield f"{url}/adapters"


def test_an_adapter_in_the_bucket_is_served_by_every_gateway_and_replica(
    bucket, engine_client, llava_dir, tiny_adapter, tmp_path, monkeypatch
):
    from loraplex.adapters.store import AdapterStore

    limits = engine_client.adapter_limits
    oracle_digest = (
        AdapterStore(adapter_store_dir(llava_dir)).put_dir(tiny_adapter, limits=limits).digest
    )
    messages = [user(image_part(data_url(photo("coffee", 96))), "Describe it")]
    expected = engine_direct(engine_client, messages, oracle_digest, max_tokens=6, temperature=0.0)

    cache = tmp_path / "core-cache"  # the cores' download cache (inherited environment)
    monkeypatch.setenv("LORAPLEX_ADAPTER_CACHE_DIR", str(cache))
    config = EngineConfig(model=str(llava_dir), served_model_name="tiny", num_kv_blocks=256)
    client = start_engine(config, bucket, in_process=False, replicas=2)
    data = tmp_path / "data"
    kw = {**NO_LIMITS, "adapter_store_url": bucket}
    try:
        with LiveGateway(client, data, **kw) as a, LiveGateway(client, data, **kw) as b:
            tenant = a.create_tenant("bucket")
            with a.client(tenant["api_key"]) as c:
                r = upload_dir(c, "my-lora", tiny_adapter)
                assert r.status_code == 201, r.text
                digest = r.json()["digest"]
            assert digest == oracle_digest
            assert b.state.store.digests() == [digest]  # in the bucket, not on a disk
            assert not (data / "adapters").exists() or not any((data / "adapters").iterdir())
            seen = []
            for gw in (b, a, b, a):
                out = gw.openai(tenant["api_key"]).chat.completions.create(
                    model="my-lora", messages=messages, max_tokens=6, temperature=0
                )
                seen.append(out.choices[0].message.content)
            assert seen == [expected.outputs[0].text] * 4
            assert AdapterStore(cache).digests() == [digest]  # a core downloaded it
            for replica in client.core.replicas.values():  # each core loads it (bucket or cache)
                asyncio.run(replica.add_lora(digest))
                with pytest.raises(RuntimeError, match="KeyError"):
                    asyncio.run(replica.add_lora("e" * 64))
            with b.client(tenant["api_key"]) as c:
                assert c.delete("/v1/adapters/my-lora").status_code in (200, 204)
            assert a.state.store.digests() == []
    finally:
        client.shutdown()
