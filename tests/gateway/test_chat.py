"""``POST /v1/chat/completions`` through the ``openai`` SDK on a live gateway: text and image
chat, streamed and not, equal to the engine run directly, with usage exactly as the client saw."""

import uuid

import pytest

from tests.gateway.chat_support import (
    data_url,
    engine_direct,
    image_part,
    long_text,
    photo,
    register_adapter,
    usage_events,
    user,
    wait_for,
)

MODEL = "tiny-llava"


def stream_chat(client, **kwargs):
    """Stream a chat; returns (texts per choice, finish reasons, usage chunk, chunks)."""
    texts, finish, usage, chunks = {}, {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        assert chunk.object == "chat.completion.chunk" and chunk.model == kwargs["model"]
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                assert choice.index not in finish, "finish_reason sent twice"
                finish[choice.index] = choice.finish_reason
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    return texts, finish, usage, chunks


def client_usage_totals(usages):
    return {
        "requests": len(usages),
        "prompt_tokens": sum(u.prompt_tokens for u in usages),
        "completion_tokens": sum(u.completion_tokens for u in usages),
        "cached_tokens": sum(u.prompt_tokens_details.cached_tokens for u in usages),
    }


def test_text_chat_equals_the_engine_and_usage_is_what_the_client_saw(live, engine_client):
    tenant = live.create_tenant("acme")
    client = live.openai(tenant["api_key"])
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three rivers and " + long_text(12)},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    direct = engine_direct(engine_client, messages, max_tokens=12, temperature=0.0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert choice.message.role == "assistant"
    assert choice.message.content == direct.outputs[0].text
    assert choice.finish_reason == direct.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(direct.prompt_token_ids)
    assert r.usage.completion_tokens == len(direct.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert choice.logprobs is None

    texts, finish, usage, _ = stream_chat(
        client,
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream_options={"include_usage": True},
    )
    assert texts == {0: choice.message.content} and finish == {0: choice.finish_reason}
    assert usage.prompt_tokens == r.usage.prompt_tokens
    assert usage.completion_tokens == r.usage.completion_tokens
    # the same prompt again from the same tenant: its full blocks come from the cache
    assert usage.prompt_tokens_details.cached_tokens > 0

    # without include_usage: no usage chunk at all
    texts2, _, usage2, chunks = stream_chat(client, model=MODEL, messages=messages, max_tokens=3)
    assert usage2 is None and all(c.usage is None for c in chunks)
    assert len(texts2) == 1

    with live.client(tenant["api_key"]) as c:
        summary = c.get("/v1/usage").json()
    seen = client_usage_totals([r.usage, usage])
    rows = usage_events(live, tenant["api_key"])
    assert len(rows) == 3 and all(row.status == "ok" for row in rows)
    assert summary["totals"]["requests"] == 3
    # the third stream had no usage chunk; its row has its own (prompt, completion) counts
    third = rows[2]
    assert third.prompt_tokens == r.usage.prompt_tokens and 1 <= third.completion_tokens <= 3
    for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        assert summary["totals"][name] == seen[name] + getattr(third, name)
    assert summary["by_model"] == [{"model": MODEL, **summary["totals"]}]
    assert all(row.key_id and row.ttft_ms > 0 and row.latency_ms >= row.ttft_ms for row in rows)


def test_image_chat_streamed_and_not(live, engine_client):
    tenant = live.create_tenant("pics")
    client = live.openai(tenant["api_key"])
    messages = [user(image_part(data_url(photo("astronaut", 96))), "What is in this picture?")]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    direct = engine_direct(engine_client, messages, max_tokens=10, temperature=0.0)
    assert r.choices[0].message.content == direct.outputs[0].text
    assert r.usage.prompt_tokens == len(direct.prompt_token_ids)
    assert r.usage.prompt_tokens > 64  # the image's 64 placeholder tokens are prompt tokens

    texts, finish, usage, _ = stream_chat(
        client,
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream_options={"include_usage": True},
    )
    assert texts[0] == r.choices[0].message.content
    assert finish[0] == r.choices[0].finish_reason
    assert usage.completion_tokens == r.usage.completion_tokens

    with live.client(tenant["api_key"]) as c:
        totals = c.get("/v1/usage").json()["totals"]
    assert totals == {
        "requests": 2,
        "prompt_tokens": 2 * r.usage.prompt_tokens,
        "completion_tokens": 2 * r.usage.completion_tokens,
        "cached_tokens": r.usage.prompt_tokens_details.cached_tokens
        + usage.prompt_tokens_details.cached_tokens,
        "images": 2,
    }


def test_sampling_parameters_and_logprobs(live):
    tenant = live.create_tenant("knobs")
    client = live.openai(tenant["api_key"])
    messages = [{"role": "user", "content": "Tell me about honey"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0.9, top_p=0.9)
    a = client.chat.completions.create(n=3, seed=7, **kw)
    b = client.chat.completions.create(n=3, seed=7, extra_body={"top_k": 0}, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # seed + i per choice
    assert 3 <= a.usage.completion_tokens <= 24
    # the same n=3 seeded request streamed: one text and one finish_reason per choice
    texts, finish, usage, _ = stream_chat(
        client, n=3, seed=7, stream_options={"include_usage": True}, **kw
    )
    assert texts == {c.index: c.message.content for c in a.choices}
    assert finish == {c.index: c.finish_reason for c in a.choices}
    assert usage.completion_tokens == a.usage.completion_tokens
    k1 = client.chat.completions.create(extra_body={"top_k": 1}, seed=1, **kw)
    k2 = client.chat.completions.create(extra_body={"top_k": 1}, seed=2, **kw)
    assert k1.choices[0].message.content == k2.choices[0].message.content  # top_k 1 is greedy

    g = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = g.choices[0].logprobs.content
    assert len(content) == g.usage.completion_tokens == 6
    # Each token's own bytes (part of a character for some): together they are the text.
    text = b"".join(bytes(t.bytes) for t in content).decode("utf-8", errors="replace")
    assert text == g.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.token == bytes(entry.bytes).decode("utf-8", errors="replace")
        best = max(t.logprob for t in entry.top_logprobs)
        assert entry.logprob == pytest.approx(best)  # greedy picks the most likely token
        assert entry.logprob <= 0

    # streamed logprobs: one entry per generated token, same values
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [
        (e.token, round(e.logprob, 5)) for e in content
    ]

    # a stop string cuts the text before it (finish_reason "stop")
    word = g.choices[0].message.content.strip().split()[1]
    s = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stop=[word]
    )
    assert s.choices[0].finish_reason == "stop" and word not in s.choices[0].message.content


def test_unknown_fields_are_refused_and_ignorable_ones_accepted(live):
    tenant = live.create_tenant("extra")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "seed": None,
    }
    with live.client(tenant["api_key"]) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
        for extra, param in (
            ({"whatever": {"nested": [1, 2]}}, "whatever"),
            ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
            ({"audio": {"voice": "alloy"}}, "audio"),
            ({"functions": [{"name": "f"}]}, "functions"),
            ({"modalities": ["text", "audio"]}, "modalities"),
            ({"n": "2"}, "n"),
            ({"stop": ["ok", 3]}, "stop[1]"),
            ({"logit_bias": {"5": 101}}, "logit_bias"),
            ({"presence_penalty": 2.5}, "presence_penalty"),
            ({"min_tokens": 3}, "min_tokens"),  # more than max_tokens (2)
            ({"cache_salt": ""}, "cache_salt"),
            (
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "image_url",
                                    "image_url": {
                                        "url": "data:image/png;base64,AAAA",
                                        "detail": "low",
                                    },
                                }
                            ],
                        }
                    ]
                },
                "messages[0].content[0].image_url.detail",
            ),
        ):
            r = c.post("/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.text)
        totals = c.get("/v1/usage").json()["totals"]
    assert totals["completion_tokens"] == 2  # the refused requests generated nothing


def test_each_executed_request_is_billed_whatever_its_x_request_id(live):
    """Reusing one X-Request-Id for different requests never merges them (issue 13: 15
    requests were billed as 2): one row each, keyed by the server's id, the client's id kept."""
    tenant = live.create_tenant("retry")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    rid = f"client-{uuid.uuid4().hex}"
    seen = []
    with live.client(tenant["api_key"]) as c:
        for n in (3, 2, 3):
            r = c.post(
                "/v1/chat/completions",
                json={**body, "max_tokens": n},
                headers={"X-Request-Id": rid},
            )
            assert r.status_code == 200, r.text
            seen.append(r.json())
        seen.append(c.post("/v1/chat/completions", json=body).json())  # no header
        totals = c.get("/v1/usage").json()["totals"]
    assert totals["requests"] == 4
    assert totals["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in seen)
    rows = usage_events(live, tenant["api_key"])
    assert [row.request_id for row in rows] == [s["id"] for s in seen]  # the response ids
    assert [row.client_request_id for row in rows] == [rid, rid, rid, None]


def test_chat_with_the_tenants_adapter_by_name(live, engine_client, tiny_adapter):
    owner = live.create_tenant("owner")
    other = live.create_tenant("other")
    digest = register_adapter(live, owner["id"], "my-lora", tiny_adapter)
    messages = [user(image_part(data_url(photo("coffee", 96))), "Describe it")]
    client = live.openai(owner["api_key"])
    r = client.chat.completions.create(
        model="my-lora", messages=messages, max_tokens=8, temperature=0
    )
    assert r.model == "my-lora"
    direct = engine_direct(engine_client, messages, digest, max_tokens=8, temperature=0.0)
    base = engine_direct(engine_client, messages, max_tokens=8, temperature=0.0)
    assert r.choices[0].message.content == direct.outputs[0].text
    assert direct.outputs[0].token_ids != base.outputs[0].token_ids  # the adapter matters

    # another tenant cannot see it: 404, as for a name that does not exist
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        live.openai(other["api_key"]).chat.completions.create(
            model="my-lora", messages=messages, max_tokens=2
        )
    assert info.value.body["code"] == "model_not_found"

    rows = usage_events(live, owner["api_key"])
    assert [(row.model, row.adapter_digest, row.images) for row in rows] == [("my-lora", digest, 1)]
    with live.client(owner["api_key"]) as c:
        by_model = c.get("/v1/usage").json()["by_model"]
    assert [m["model"] for m in by_model] == ["my-lora"]


def test_inflight_requests_are_registered_for_graceful_shutdown(live):
    import threading

    tenant = live.create_tenant("inflight")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 60}
    result = {}

    def call():
        with live.client(tenant["api_key"]) as c:
            result["r"] = c.post("/v1/chat/completions", json=body)

    t = threading.Thread(target=call)
    t.start()
    seen = wait_for(lambda: len(live.state.in_flight), timeout=20, interval=0.002)
    t.join()
    assert seen == 1
    assert result["r"].status_code == 200
    assert wait_for(lambda: not live.state.in_flight)
