"""``POST /v1/completions``, ``/tokenize``, ``/detokenize`` and ``/version`` through the
``openai`` SDK and httpx on a live gateway: the completion equals the engine's for the same
prompt ids, streaming adds up to it, usage and rate limits apply, malformed input is a 400."""

import openai
import pytest

from tests.gateway.chat_support import register_adapter
from tests.media import data_url, long_text, photo

MODEL = "tiny-llava"
PROMPT = "The river ran past the old house and"


@pytest.fixture
def tenant(live):
    return live.create_tenant("acme")


@pytest.fixture
def client(live, tenant):
    return live.openai(tenant["api_key"])


def test_text_and_token_prompts_agree_with_tokenize(live, client, tenant):
    with live.client(tenant["api_key"]) as c:
        tok = c.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
        back = c.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()
        assert back["prompt"].endswith(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(
        model=MODEL, prompt=tok["tokens"], max_tokens=8, temperature=0
    )
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == tok["count"]
    assert by_text.usage.completion_tokens == 8
    default = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens here


def test_streaming_echo_logprobs_n_and_cached_tokens(client):
    whole = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == whole.choices[0].text
    streamed = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6
    echo = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert echo.choices[0].text.startswith(PROMPT)
    several = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=3, seed=7)
    assert sorted(c.index for c in several.choices) == [0, 1, 2]
    long_prompt = long_text(200, seed=3)
    client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * (
        again.usage.prompt_tokens // 16 - 1
    )


def test_adapter_by_name_and_usage_rows(live, client, tenant, tiny_adapter):
    register_adapter(live, tenant["id"], "my-lora", tiny_adapter)
    r = client.completions.create(model="my-lora", prompt=PROMPT, max_tokens=3)
    assert r.model == "my-lora" and r.usage.completion_tokens == 3
    with live.client(tenant["api_key"]) as c:
        assert c.post("/tokenize", json={"model": "my-lora", "prompt": "hi"}).status_code == 200
        by_model = {m["model"]: m for m in c.get("/v1/usage").json()["by_model"]}
    assert by_model["my-lora"]["completion_tokens"] == 3
    assert by_model["my-lora"]["requests"] == 2  # the completion and the tokenize call


def test_chat_form_of_tokenize_is_the_chat_prompt(live, client, tenant):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": data_url(photo("coffee"))}},
            ],
        }
    ]
    with live.client(tenant["api_key"]) as c:
        tok = c.post(
            "/tokenize", json={"model": MODEL, "messages": messages, "return_token_strs": True}
        ).json()
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert tok["count"] == chat.usage.prompt_tokens
    assert len(tok["token_strs"]) == tok["count"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "suffix": "b"}, "suffix"),
        ({"prompt": ["a", [1]]}, "prompt"),
        ({"prompt": [1, "x"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [10_000_000]}, "prompt"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "extra_body": {"messages": []}}, "messages"),
        ({"prompt": "a" * 400_000}, "prompt"),
    ],
)
def test_malformed_completions_are_400_naming_the_field(client, body, param):
    with pytest.raises((openai.BadRequestError, openai.APIStatusError)) as err:
        client.completions.create(model=MODEL, max_tokens=2, **body)
    if err.value.status_code == 413:  # the oversized prompt may hit the body limit first
        return
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body


def test_tokenizer_endpoints_refuse_and_version_needs_no_key(live, tenant):
    with live.client(tenant["api_key"]) as c:
        for path, body, status, param in (
            ("/detokenize", {"model": MODEL, "tokens": [10_000_000]}, 400, "tokens"),
            ("/tokenize", {"model": MODEL, "prompt": "x", "extra": 1}, 400, "extra"),
            ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
            ("/tokenize", {"model": MODEL, "messages": []}, 400, "messages"),
        ):
            r = c.post(path, json=body)
            assert r.status_code == status, r.text
            assert r.json()["error"]["param"] == param
    with live.client(None) as anonymous:
        assert anonymous.post("/tokenize", json={"model": MODEL, "prompt": "x"}).status_code == 401
        v = anonymous.get("/version")
        assert v.status_code == 200 and v.json()["version"]
