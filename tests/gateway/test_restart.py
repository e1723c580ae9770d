"""Usage survives a restart: same data directory, new gateway, same totals (issue 5).

The first gateway batches usage rows for 3 s and is stopped right after the last answer, so
rows still queued at that moment exist after the restart only if the graceful shutdown (the path
of SIGINT / SIGTERM for ``loraplex serve``) flushed them.
"""

import time
from pathlib import Path

import pytest

from tests.gateway.chat_support import data_url, image_part, photo, user
from tests.gateway.conftest import adapter_store_dir
from tests.gateway.live import LiveGateway

pytestmark = pytest.mark.slow

MODEL = "tiny-llava"
FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "images")


def usage(gw, key):
    with gw.client(key) as c:
        r = c.get("/v1/usage")
        assert r.status_code == 200, r.text
        return r.json()


def add(totals, u, images=0):
    out = dict(totals)
    out["requests"] += 1
    out["prompt_tokens"] += u.prompt_tokens
    out["completion_tokens"] += u.completion_tokens
    out["cached_tokens"] += u.prompt_tokens_details.cached_tokens
    out["images"] += images
    return out


def test_usage_survives_a_restart_and_the_shutdown_flushes(engine_client, tmp_path):
    store = adapter_store_dir(Path(engine_client.config.model))
    data = tmp_path / "data"
    hi = [{"role": "user", "content": "Say hello."}]
    with LiveGateway(engine_client, data, adapter_store_dir=store, usage_flush_seconds=3) as gw:
        tenant = gw.create_tenant("durable")
        key = tenant["api_key"]
        client = gw.openai(key)
        expected = dict.fromkeys(FIELDS, 0)
        answer = client.chat.completions.create(model=MODEL, messages=hi, max_tokens=3)
        expected = add(expected, answer.usage)
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[user("What is this?", image_part(data_url(photo(size=64))))],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        expected = add(expected, chunks[-1].usage, images=1)
        last = client.chat.completions.create(model=MODEL, messages=hi, max_tokens=2)
        expected = add(expected, last.usage)
        assert gw.state.usage.pending >= 1  # queued: only the shutdown can write it now

    with LiveGateway(engine_client, data, adapter_store_dir=store) as gw:
        after = usage(gw, key)  # the same key still authenticates: the secret persisted
        assert after["tenant"] == tenant["id"]
        assert after["totals"] == expected
        assert after["by_model"] == [{"model": MODEL, **expected}]
        again = gw.openai(key).chat.completions.create(model=MODEL, messages=hi, max_tokens=2)
        assert usage(gw, key)["totals"] == add(expected, again.usage)

    deadline = time.monotonic() + 10
    while engine_client.stats()["kv_blocks_in_use"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_client.stats()["kv_blocks_in_use"] == 0, "KV blocks leaked"
