"""Bounds before work (issue 13): every numeric field has a range and gets 400 outside it, any
malformed body is a 400 (never a 500), and a prompt too big for the model is refused before it
is tokenized or its images decoded."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from loraplex.engine.client.processing import max_token_bytes
from tests.gateway.chat_support import image_part, usage_events, user
from tests.gateway.test_app_basics import assert_openai_error

# The slow tier: the fast tier (-m 'not slow and not service') must stay under two minutes.
pytestmark = pytest.mark.slow

MODEL = "tiny-llava"
HI = [{"role": "user", "content": "hi"}]


def chat(**changes):
    body = {"model": MODEL, "messages": HI, "max_tokens": 2}
    body.update(changes)
    return body


OUT_OF_RANGE = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_completion_tokens": 10**30}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"n": 9223372036854775808}, "n"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 1e308}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.0000001}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 9223372036854775808}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 2**70}, "top_logprobs"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": 1.5}, "top_k"),
    ({"n": True}, "n"),
    ({"stop": ["x" * 1025]}, "stop"),
    ({"stop": ["s"] * 17}, "stop"),
]


def post(live, key, body=None, content=None, path="/v1/chat/completions"):
    with live.client(key) as c:
        if content is not None:
            return c.post(path, content=content, headers={"content-type": "application/json"})
        return c.post(path, json=body)


def test_every_numeric_field_out_of_range_is_a_400_naming_it(live):
    tenant = live.create_tenant("ranges")
    for changes, param in OUT_OF_RANGE:
        err = assert_openai_error(post(live, tenant["api_key"], chat(**changes)), 400)
        assert err["param"] == param, (changes, err)
    rows = usage_events(live, tenant["api_key"])
    assert len(rows) == len(OUT_OF_RANGE) and {r.status for r in rows} == {"error"}
    with live.client(tenant["api_key"]) as c:  # the engine is fine afterwards
        assert c.post("/v1/chat/completions", json=chat()).status_code == 200


MALFORMED = [
    b"[" * 5000 + b"]" * 5000,  # nested past the decoder's recursion limit
    b'{"model": "tiny-llava", "messages": [{"role": "user", "content": "\xff"}]}',
    b'{"model": "tiny-llava", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
    b'{"model": "tiny-llava", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "tiny-llava", "temperature": 1e999, "messages": []}',
    b'{"model": "tiny-llava", "messages": [',
    b"\xef\xbb\xbf\xff\xfe",
    b"",
]


def test_malformed_bodies_are_400_on_every_json_route(live):
    tenant = live.create_tenant("malformed")
    for raw in MALFORMED:
        err = assert_openai_error(post(live, tenant["api_key"], content=raw), 400)
        assert err["type"] == "invalid_request_error", raw[:40]
        for path in ("/admin/tenants", "/admin/tenants/x/limits"):
            with live.admin() as a:
                method = a.put if path.endswith("limits") else a.post
                r = method(path, content=raw, headers={"content-type": "application/json"})
            assert_openai_error(r, 400)


def test_a_prompt_too_big_for_the_model_is_refused_before_tokenizing(
    live, engine_client, monkeypatch
):
    tenant = live.create_tenant("big")
    limits = engine_client.input_limits
    calls = []
    process = engine_client.process

    async def counting(messages, **kw):
        calls.append(len(str(messages)))
        return await process(messages, **kw)

    monkeypatch.setattr(engine_client, "process", counting)
    huge = "lorem ipsum " * 500_000  # 6 MB of text
    just_over = "x" * (engine_client.max_model_len * limits.max_token_bytes)
    for text in (huge, just_over):
        err = assert_openai_error(post(live, tenant["api_key"], chat(messages=[user(text)])), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    many = [{"role": "user", "content": ""}] * (engine_client.max_model_len + 1)
    err = assert_openai_error(post(live, tenant["api_key"], chat(messages=many)), 400)
    assert err["code"] == "context_length_exceeded"
    nine = [user(*[image_part("data:image/png;base64,AAAA")] * (limits.max_images + 1), "hi")]
    err = assert_openai_error(post(live, tenant["api_key"], chat(messages=nine)), 400)
    assert "at most" in err["message"]
    assert calls == []  # none of them reached the tokenizer or an image decoder
    # A long prompt that fits is not refused by the estimate.
    fits = "lorem ipsum " * 40
    assert post(live, tenant["api_key"], chat(messages=[user(fits)])).status_code == 200
    assert len(calls) == 1


@pytest.fixture(scope="module")
def tiny_tokenizer(llava_dir):
    return AutoTokenizer.from_pretrained(llava_dir)


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1, max_size=200))
def test_max_token_bytes_bounds_the_token_count_from_below(tiny_tokenizer, text):
    limit = max_token_bytes(tiny_tokenizer)
    specials = "".join(tiny_tokenizer.all_special_tokens)
    for sample in (text, specials + text, text * 3 + specials):
        ids = tiny_tokenizer.encode(sample, add_special_tokens=False)
        assert len(ids) * limit >= len(sample.encode("utf-8", "surrogatepass"))
