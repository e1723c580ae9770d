"""The key gateway flows on PostgreSQL: a live gateway with ``--db-url postgresql+asyncpg://``.

Tenant creation, chat (JSON and streamed with an image) with usage equal to what the client saw,
two requests sharing an ``X-Request-Id`` billed as two, a revoked key refused, and the totals
surviving a restart. Set ``LORAPLEX_TEST_PG_URL`` to a database these tests may wipe
(``.ci/postgres.sh`` starts one); skipped otherwise.
"""

import os
import time
from pathlib import Path

import openai
import pytest

from loraplex.gateway.db.session import db_url
from tests.gateway.chat_support import data_url, image_part, photo, user
from tests.gateway.conftest import adapter_store_dir, wipe_pg
from tests.gateway.live import LiveGateway
from tests.gateway.test_app_basics import assert_openai_error

PG_URL = os.environ.get("LORAPLEX_TEST_PG_URL")

pytestmark = [
    pytest.mark.service,
    pytest.mark.skipif(not PG_URL, reason="LORAPLEX_TEST_PG_URL is not set"),
]

MODEL = "tiny-llava"
HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def pg_url():
    url = db_url(".", PG_URL)
    wipe_pg(url)
    return url


def usage(gw, key):
    with gw.client(key) as c:
        r = c.get("/v1/usage")
        assert r.status_code == 200, r.text
        return r.json()


def test_key_flows_on_postgresql(engine_client, pg_url, tmp_path):
    store = adapter_store_dir(Path(engine_client.config.model))
    data = tmp_path / "data"
    with LiveGateway(engine_client, data, db=pg_url, adapter_store_dir=store) as gw:
        assert gw.state.db.dialect.name == "postgresql"
        tenant = gw.create_tenant("pg-acme")
        other = gw.create_tenant("pg-other")
        key = tenant["api_key"]
        client = gw.openai(key)

        answer = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[user("What is this?", image_part(data_url(photo(size=64))))],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        seen = [answer.usage, chunks[-1].usage]
        # the same X-Request-Id twice: two executed requests, two usage rows
        with gw.client(key) as c:
            body = {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0}
            for _ in range(2):
                r = c.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "retry-1"})
                assert r.status_code == 200, r.text
                seen.append(r.json()["usage"])
        seen = [u if isinstance(u, dict) else u.model_dump() for u in seen]

        expected = {
            "requests": 4,
            "prompt_tokens": sum(u["prompt_tokens"] for u in seen),
            "completion_tokens": sum(u["completion_tokens"] for u in seen),
            "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in seen),
            "images": 1,
        }
        got = usage(gw, key)
        assert got["tenant"] == tenant["id"]
        assert got["totals"] == expected
        assert got["by_model"] == [{"model": MODEL, **expected}]
        assert usage(gw, other["api_key"])["totals"]["requests"] == 0

        # a second key, revoked: 401 from then on; the first key still works
        with gw.admin() as a:
            second = a.post(f"/admin/tenants/{tenant['id']}/keys").json()
            assert gw.openai(second["api_key"]).models.list().data
            r = a.delete(f"/admin/keys/{second['id']}")
            assert r.status_code == 200, r.text
        with gw.client(second["api_key"]) as c:
            assert_openai_error(c.get("/v1/usage"), 401)
        with pytest.raises(openai.AuthenticationError):
            gw.openai(second["api_key"]).chat.completions.create(model=MODEL, messages=HI)
        last = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        expected["requests"] += 1
        expected["prompt_tokens"] += last.usage.prompt_tokens
        expected["completion_tokens"] += last.usage.completion_tokens
        expected["cached_tokens"] += last.usage.prompt_tokens_details.cached_tokens

    # restart on the same database and data directory (the key-hashing secret)
    with LiveGateway(engine_client, data, db=pg_url, adapter_store_dir=store) as gw:
        assert usage(gw, key)["totals"] == expected
        with gw.client(second["api_key"]) as c:
            assert_openai_error(c.get("/v1/usage"), 401)

    deadline = time.monotonic() + 10
    while engine_client.stats()["kv_blocks_in_use"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_client.stats()["kv_blocks_in_use"] == 0, "KV blocks leaked"


def test_two_gateways_on_one_database_share_keys_usage_and_revocations(
    engine_client, pg_url, tmp_path
):
    """Issue 18: gateways are stateless in tenants, keys and usage. Two gateways over one
    PostgreSQL database and one data directory (its key secret and adapter store): a key made
    through one works on the other, usage from both is one ledger, and a key revoked through
    one is refused by the other within ``auth_cache_seconds``."""
    store = adapter_store_dir(Path(engine_client.config.model))
    data = tmp_path / "data"
    kw = {"db": pg_url, "adapter_store_dir": store}
    with LiveGateway(engine_client, data, **kw) as a, LiveGateway(engine_client, data, **kw) as b:
        tenant = a.create_tenant("shared")
        key = tenant["api_key"]
        for gw in (a, b, b):
            gw.openai(key).chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        # Each gateway spools its rows and commits them in groups: one ledger, soon.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            counts = [usage(gw, key)["totals"]["requests"] for gw in (a, b)]
            if counts == [3, 3]:
                break
            time.sleep(0.1)
        assert counts == [3, 3]
        with a.admin() as c:
            assert c.delete(f"/admin/keys/{tenant['key_id']}").status_code in (200, 204)
        deadline = time.monotonic() + b.state.config.auth_cache_seconds + 3
        while time.monotonic() < deadline:
            with b.client(key) as c:
                if c.get("/v1/models").status_code == 401:
                    break
            time.sleep(0.1)
        with b.client(key) as c:
            assert c.get("/v1/models").status_code == 401
