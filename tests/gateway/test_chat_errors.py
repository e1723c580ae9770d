"""Bad input to ``POST /v1/chat/completions``: the contract's status, OpenAI's error body, and
nothing leaked (KV blocks back to zero, rate-limit tickets released, one usage row each)."""

import base64
import json

import httpx
import openai
import pytest

from tests.gateway.chat_support import (
    add_adapter_row,
    data_url,
    image_part,
    long_text,
    photo,
    png_bomb,
    prompt_ids,
    usage_events,
    user,
    wait_for,
)
from tests.gateway.live import LiveGateway
from tests.gateway.test_app_basics import assert_openai_error

# The slow tier: the fast tier (-m 'not slow and not service') must stay under two minutes.
pytestmark = pytest.mark.slow

MODEL = "tiny-llava"
HI = [{"role": "user", "content": "hi"}]


def chat_body(**changes):
    body = {"model": MODEL, "messages": HI, "max_tokens": 2}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not ...}


def post(live, key, body=None, *, content=None, headers=None):
    with live.client(key) as c:
        if content is not None:
            headers = {"content-type": "application/json", **(headers or {})}
            return c.post("/v1/chat/completions", content=content, headers=headers)
        return c.post("/v1/chat/completions", json=body, headers=headers)


def images_message(*urls):
    return [user(*[image_part(u) for u in urls], "what is this?")]


def test_missing_wrong_and_revoked_keys_are_401_admin_key_is_403(live):
    tenant = live.create_tenant("keys")
    assert_openai_error(post(live, None, chat_body()), 401)
    assert_openai_error(post(live, "lpx-" + "0" * 43, chat_body()), 401)
    with live.client() as c:
        r = c.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Basic x"})
    assert_openai_error(r, 401)
    with pytest.raises(openai.AuthenticationError):
        live.openai("lpx-wrong").chat.completions.create(model=MODEL, messages=HI)
    err = assert_openai_error(post(live, live.admin_key, chat_body()), 403)
    assert err["type"] == "permission_error"

    with live.admin() as a:
        key = a.post(f"/admin/tenants/{tenant['id']}/keys").json()
        assert post(live, key["api_key"], chat_body()).status_code == 200
        assert a.delete(f"/admin/keys/{key['id']}").status_code == 200
    err = assert_openai_error(post(live, key["api_key"], chat_body()), 401)
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"


def _bad_requests(engine_client):
    too_long = [{"role": "user", "content": long_text(4500)}]
    assert len(prompt_ids(engine_client, too_long)) > engine_client.max_model_len
    url_param = "messages[0].content[0].image_url.url"
    ok_png = data_url(photo("coffee", 64))
    # (what, body or raw bytes, param expected (None: any), code expected (None: any))
    return [
        ("malformed JSON", b'{"model": "tiny-llava", "messages": [', None, None),
        ("not an object", b"[1, 2]", None, None),
        ("missing messages", chat_body(messages=...), "messages", None),
        ("empty messages", chat_body(messages=[]), "messages", None),
        ("messages a string", chat_body(messages="hi"), "messages", None),
        ("message without role", chat_body(messages=[{"content": "x"}]), "messages[0]", None),
        (
            "content a number",
            chat_body(messages=[{"role": "user", "content": 5}]),
            "messages[0].content",
            None,
        ),
        (
            "unknown part type",
            chat_body(messages=[{"role": "user", "content": [{"type": "audio"}]}]),
            "messages[0].content[0].type",
            None,
        ),
        ("missing model", chat_body(model=...), "model", None),
        ("model a number", chat_body(model=5), "model", None),
        ("max_tokens a string", chat_body(max_tokens="10"), "max_tokens", None),
        ("max_tokens zero", chat_body(max_tokens=0), "max_tokens", None),
        ("max_tokens over the limit", chat_body(max_tokens=5000), "max_tokens", None),
        (
            "max_completion_tokens over the limit",
            chat_body(max_completion_tokens=4097),
            "max_completion_tokens",
            None,
        ),
        ("n over max_n", chat_body(n=9), "n", None),
        ("temperature negative", chat_body(temperature=-1), "temperature", None),
        ("temperature a string", chat_body(temperature="hot"), "temperature", None),
        ("top_p zero", chat_body(top_p=0), "top_p", None),
        ("top_k a float", chat_body(top_k=1.5), "top_k", None),
        ("seed a bool", chat_body(seed=True), "seed", None),
        ("stream a string", chat_body(stream="yes"), "stream", None),
        ("top_logprobs alone", chat_body(top_logprobs=2), "top_logprobs", None),
        ("top_logprobs 21", chat_body(logprobs=True, top_logprobs=21), "top_logprobs", None),
        ("stop a number", chat_body(stop=5), "stop", None),
        ("stop empty string", chat_body(stop=[""]), "stop", None),
        (
            "https image URL",
            chat_body(messages=images_message("https://example.com/cat.png")),
            url_param,
            "invalid_image_url",
        ),
        (
            "file image URL",
            chat_body(messages=images_message("file:///etc/passwd")),
            url_param,
            "invalid_image_url",
        ),
        (
            "ftp image URL",
            chat_body(messages=images_message("ftp://example.com/a.png")),
            url_param,
            "invalid_image_url",
        ),
        (
            "invalid base64",
            chat_body(messages=images_message("data:image/png;base64,@@@not-base64@@@")),
            "messages[0].content[0]",
            None,
        ),
        (
            "not an image",
            chat_body(
                messages=images_message(
                    "data:image/png;base64," + base64.b64encode(b"hello, world" * 10).decode()
                )
            ),
            "messages[0].content[0]",
            None,
        ),
        (
            "gif media type",
            chat_body(messages=images_message("data:image/gif;base64,R0lGODlhAQABAAAAACw=")),
            "messages[0].content[0]",
            None,
        ),
        (
            "decompression bomb",
            chat_body(messages=images_message(data_url(png_bomb()))),
            "messages[0].content[0]",
            None,
        ),
        ("too many images", chat_body(messages=images_message(*[ok_png] * 9)), "messages", None),
        (
            "prompt over max_model_len",
            chat_body(messages=too_long, max_tokens=...),
            "messages",
            "context_length_exceeded",
        ),
        (
            "prompt + max_tokens over max_model_len",
            chat_body(messages=[{"role": "user", "content": long_text(2500)}], max_tokens=4000),
            "max_tokens",
            "context_length_exceeded",
        ),
    ]


def test_bad_requests_are_400_with_one_error_usage_row_each(live, engine_client):
    tenant = live.create_tenant("bad")
    key = tenant["api_key"]
    cases = _bad_requests(engine_client)
    for what, body, param, code in cases:
        if isinstance(body, bytes):
            r = post(live, key, content=body)
        else:
            r = post(live, key, body)
        err = assert_openai_error(r, 400, code)
        assert err["type"] == "invalid_request_error", what
        if param is not None:
            assert err["param"] == param, (what, err)
        assert "Traceback" not in err["message"] and "lpx-" not in err["message"]
    # a bad X-Request-Id is a 400 too (and the row is keyed by the response id instead)
    r = post(live, key, chat_body(), headers={"X-Request-Id": "has spaces in it"})
    assert assert_openai_error(r, 400)["param"] == "X-Request-Id"
    # nothing reached the engine: one "error" row per request, no tokens
    rows = usage_events(live, key)
    assert len(rows) == len(cases) + 1
    assert {row.status for row in rows} == {"error"}
    assert all(row.error_type for row in rows)
    assert (
        sum(r.prompt_tokens + r.completion_tokens + r.cached_tokens + r.images for r in rows) == 0
    )
    assert {row.model for row in rows} >= {MODEL, "(invalid request)"}
    assert live.state.limiter.in_flight(rows[0].key_id) == 0  # every ticket released
    # the tenant can still chat afterwards
    assert post(live, key, chat_body()).status_code == 200


def test_unknown_model_and_another_tenants_adapter_are_404(live):
    owner = live.create_tenant("owner")
    other = live.create_tenant("other")
    add_adapter_row(live, owner["id"], "private-lora", "f" * 64)
    for model in ("nope", "private-lora", "x" * 300, "TINY-LLAVA"):
        err = assert_openai_error(post(live, other["api_key"], chat_body(model=model)), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        live.openai(other["api_key"]).chat.completions.create(
            model="private-lora", messages=HI, max_tokens=2
        )
    rows = usage_events(live, other["api_key"])
    assert [row.error_type for row in rows] == ["model_not_found"] * 5
    assert usage_events(live, owner["api_key"]) == []


def test_an_adapter_the_engine_cannot_load_is_503_not_a_hang(live):
    tenant = live.create_tenant("broken")
    add_adapter_row(live, tenant["id"], "gone-lora", "e" * 64)  # no such files in the store
    err = assert_openai_error(post(live, tenant["api_key"], chat_body(model="gone-lora")), 503)
    assert err["code"] == "request_aborted"
    rows = usage_events(live, tenant["api_key"])
    assert [(r.status, r.error_type) for r in rows] == [("error", "engine_abort")]


def test_oversized_body_is_413(engine_client, tmp_path):
    with LiveGateway(engine_client, tmp_path / "data", chat_max_body_bytes=64 * 1024) as gw:
        tenant = gw.create_tenant("big")
        big = data_url(b"\x89PNG" + b"\0" * 150_000)
        r = post(gw, tenant["api_key"], chat_body(messages=images_message(big)))
        err = assert_openai_error(r, 413)
        assert err["code"] == "request_too_large"
        # just under the limit is served (an ignored field makes the bulk: a cheap prompt)
        body = chat_body(user="p" * 60_000)
        assert 60_000 < len(json.dumps(body)) < 64 * 1024
        assert post(gw, tenant["api_key"], body).status_code == 200
        rows = usage_events(gw, tenant["api_key"])  # the body is read before admission:
        assert [(r.status, r.error_type) for r in rows] == [("ok", None)]  # 413 leaves no row


def test_rate_limits_are_429_with_retry_after_and_no_usage_row(live):
    tenant = live.create_tenant("limited")
    key = tenant["api_key"]
    with live.admin() as a:
        r = a.put(f"/admin/tenants/{tenant['id']}/limits", json={"requests_per_minute": 2})
        assert r.status_code == 200, r.text
    assert post(live, key, chat_body()).status_code == 200
    assert post(live, key, chat_body()).status_code == 200
    r = post(live, key, chat_body())
    err = assert_openai_error(r, 429, "rate_limit_exceeded")
    assert err["type"] == "rate_limit_error" and "requests_per_minute" in err["message"]
    assert int(r.headers["Retry-After"]) >= 1
    with pytest.raises(openai.RateLimitError):
        live.openai(key).chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert len(usage_events(live, key)) == 2
    metrics = live.metrics()
    line = (
        f'loraplex_rate_limited_requests_total{{limit="requests_per_minute",'
        f'tenant="{tenant["id"]}"}} 2.0'
    )
    assert line in metrics


def test_concurrency_limit_holds_while_streaming_and_frees_after(live):
    tenant = live.create_tenant("one-at-a-time")
    key = tenant["api_key"]
    with live.admin() as a:
        a.put(f"/admin/tenants/{tenant['id']}/limits", json={"max_concurrent_requests": 1})
    with live.client(key) as c:
        body = chat_body(max_tokens=30, stream=True)
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            r = post(live, key, chat_body())  # while the stream runs
            err = assert_openai_error(r, 429)
            assert "max_concurrent_requests" in err["message"] and r.headers["Retry-After"]
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
    assert wait_for(lambda: post(live, key, chat_body()).status_code == 200, timeout=5)


def _aborted_row(live, key):
    def find():
        rows = usage_events(live, key)
        return rows if rows and rows[-1].status != "ok" else None

    rows = wait_for(find, timeout=15)
    assert rows, "no usage row for the aborted request"
    return rows[-1]


def test_client_disconnect_mid_stream_aborts_the_request(live, engine_client):
    tenant = live.create_tenant("leaver")
    key = tenant["api_key"]
    body = chat_body(max_tokens=3000, stream=True, temperature=0)
    contents = 0
    with live.client(key) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            assert s.headers["content-type"].startswith("text/event-stream")
            for line in s.iter_lines():
                if '"content":"' in line:
                    contents += 1
                if contents >= 4:
                    break  # leaving the block closes the connection mid-stream
    row = _aborted_row(live, key)
    assert (row.status, row.error_type) == ("aborted", "client_disconnected")
    assert 3 <= row.completion_tokens < 3000 and row.prompt_tokens > 0
    assert wait_for(lambda: engine_client.stats()["kv_blocks_in_use"] == 0)
    assert not engine_client.core.engine_core.scheduler.requests
    assert not live.state.in_flight


def test_engine_abort_mid_stream_is_an_error_event_then_done(live, engine_client):
    tenant = live.create_tenant("cut")
    key = tenant["api_key"]
    client = live.openai(key)
    stream = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3000, temperature=0, stream=True
    )
    with pytest.raises(openai.APIError) as info:
        for i, chunk in enumerate(stream):
            if i == 3:
                engine_client.abort(chunk.id)  # the engine drops it (as on its shutdown)
    assert "aborted" in info.value.message
    row = _aborted_row(live, key)
    assert (row.status, row.error_type) == ("error", "engine_abort")
    assert 1 <= row.completion_tokens < 3000
    metrics = live.metrics()
    assert (
        f'loraplex_tenant_requests_total{{status="error",tenant="{tenant["id"]}"}} 1.0' in metrics
    )


def test_client_that_gives_up_before_the_answer_aborts_the_request(
    live, engine_client, monkeypatch
):
    # No EOS for this test's sequences: 3000 random tokens always outlast the client's 0.5 s.
    monkeypatch.setattr(engine_client.core.engine_core.scheduler, "eos_token_ids", frozenset())
    tenant = live.create_tenant("impatient")
    key = tenant["api_key"]
    with httpx.Client(base_url=live.base_url, timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(
                "/v1/chat/completions",
                json=chat_body(max_tokens=3000),
                headers={"Authorization": f"Bearer {key}"},
            )
    row = _aborted_row(live, key)
    assert (row.status, row.error_type) == ("aborted", "client_disconnected")
    assert row.completion_tokens < 3000
    assert wait_for(lambda: engine_client.stats()["kv_blocks_in_use"] == 0)


def test_draining_server_answers_503(live):
    tenant = live.create_tenant("late")
    live.state.draining = True
    try:
        err = assert_openai_error(post(live, tenant["api_key"], chat_body()), 503)
        assert err["type"] == "service_unavailable"
    finally:
        live.state.draining = False
    assert usage_events(live, tenant["api_key"]) == []
