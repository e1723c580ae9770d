"""The schema attacks of issue 27 against a gateway over an engine core process: every one is a
400 naming the field, before anything native runs in the core or after the grammar sandbox
refused it, and the core never dies (same pid, no restart)."""

import json
import time

import httpx
import pytest

from loraplex.engine.config import EngineConfig
from loraplex.engine.core.process import STATS_EVERY_S
from loraplex.gateway.server.build import start_engine
from tests.engine.test_grammar_bounds import chain
from tests.gateway.live import LiveGateway

pytestmark = pytest.mark.slow


def nested(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"items": schema}
    return schema


@pytest.fixture(scope="module")
def gateway(tiny_text_dir, tmp_path_factory):
    config = EngineConfig(model=str(tiny_text_dir), served_model_name="tiny", num_kv_blocks=128)
    client = start_engine(config, tmp_path_factory.mktemp("store"), in_process=False)
    with LiveGateway(client, tmp_path_factory.mktemp("data")) as live:
        key = live.create_tenant("mallory")["api_key"]
        with httpx.Client(
            base_url=live.base_url, timeout=120, headers={"Authorization": f"Bearer {key}"}
        ) as c:
            yield client, c
    client.shutdown()


def chat(c, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "JSON please"}]}
    return c.post("/v1/chat/completions", json={**body, "max_tokens": 8, **extra})


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


CASES = [
    # the 1,050-link anyOf chain (65,040 characters), three ways in
    ("chat", {"response_format": fmt(chain(1050, "anyOf"))}, "response_format"),
    ("chat", {"guided_json": json.dumps(chain(1050, "anyOf"))}, "guided_json"),
    ("completions", {"response_format": fmt(chain(1050, "anyOf"))}, "response_format"),
    # the same chain through the other keywords (shorter: each link is longer)
    ("chat", {"guided_json": chain(900, "items")}, "guided_json"),
    ("chat", {"guided_json": chain(800, "properties")}, "guided_json"),
    ("chat", {"guided_json": chain(900, "allOf")}, "guided_json"),
    ("chat", {"guided_json": chain(900, "oneOf")}, "guided_json"),
    # grammars that can never produce a token, and a regex past the repetition bound
    ("chat", {"guided_json": {"$ref": "#"}}, "guided_json"),
    ("chat", {"guided_regex": "a{1000000}"}, "guided_regex"),
    ("chat", {"guided_regex": "((ab){100}){101}"}, "guided_regex"),
    # an object of 2,200 optional properties (about 1 s to compile on a 49k vocabulary)
    (
        "chat",
        {"guided_json": {"type": "object", "properties": {f"p{i}": {} for i in range(2200)}}},
        "guided_json",
    ),
    # a forced tool call whose parameters nest too deep once wrapped in the call's own schema
    (
        "chat",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": nested(64)}}],
            "tool_choice": "required",
        },
        "tools",
    ),
]


@pytest.mark.parametrize(
    "route,extra,param", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_every_schema_attack_is_a_400_and_the_core_lives(gateway, route, extra, param):
    client, c = gateway
    pid = client.core.pid
    if route == "chat":
        r = chat(c, **extra)
    else:
        r = c.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4, **extra}
        )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or error["param"].startswith(param), error
    assert client.core.pid == pid and client.core.restarts == 0
    ok = chat(c, guided_regex="(yes|no)")
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_a_schema_that_allows_no_token_is_refused_by_the_sandbox_and_cached(gateway):
    client, c = gateway
    schema = {"$ref": "#", "title": "a text of its own, so a digest of its own"}
    time.sleep(2 * STATS_EVERY_S)  # the core's statistics arrive with its messages
    before = client.stats()["grammar_vetted"]
    r = chat(c, guided_json=schema)
    assert r.status_code == 400 and "allows no token" in r.json()["error"]["message"], r.text
    assert chat(c, guided_json=schema).status_code == 400
    time.sleep(2 * STATS_EVERY_S)
    assert client.stats()["grammar_vetted"] == before + 1  # the refusal was cached
    assert client.stats()["grammar_refused"] >= 2  # {"$ref": "#"} of the attacks, and this one
