"""Batched prompts in ``POST /v1/completions`` through the ``openai`` SDK on a live gateway.

A list of prompts (strings or token-id lists) is one request: choice ``i * n + j`` is prompt
``i``'s ``j``-th sample and equals what that prompt alone gets, usage is summed into one usage
row, streaming sends every choice's text and its own finish; bounded like ``n``; one prompt's
failure or the client leaving aborts every prompt's engine request (no KV block leaks: the
``live`` fixture checks).
"""

import openai
import pytest

from tests.gateway.chat_support import usage_events, wait_for

MODEL = "tiny-llava"
PROMPTS = ["The river ran past the old house and", "Once upon a time", "Colours of the sea:"]


@pytest.fixture
def tenant(live):
    return live.create_tenant("batcher")


@pytest.fixture
def client(live, tenant):
    return live.openai(tenant["api_key"])


def _texts_by_index(choices):
    return {c.index: c.text for c in choices}


def test_a_batch_of_prompts_is_each_prompt_alone_in_one_usage_row(live, client, tenant):
    args = {"model": MODEL, "max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    batch = client.completions.create(prompt=PROMPTS, n=2, **args)
    assert [c.index for c in batch.choices] == list(range(6))
    assert all(c.finish_reason == "length" for c in batch.choices)
    rows = usage_events(live, tenant["api_key"])
    assert len(rows) == 1 and rows[0].status == "ok"  # one request, one row

    alone = [client.completions.create(prompt=p, **args) for p in PROMPTS]
    for i, one in enumerate(alone):
        for j in range(2):  # greedy: both samples of prompt i are its completion alone
            assert batch.choices[i * 2 + j].text == one.choices[0].text, (i, j)
    prompt_tokens = sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.prompt_tokens == prompt_tokens
    assert batch.usage.completion_tokens == 6 * 5
    assert batch.usage.total_tokens == prompt_tokens + 30
    row = usage_events(live, tenant["api_key"])[0]
    assert (row.prompt_tokens, row.completion_tokens) == (prompt_tokens, 30)

    with live.client(tenant["api_key"]) as c:
        ids = [
            c.post("/tokenize", json={"model": MODEL, "prompt": p}).json()["tokens"]
            for p in PROMPTS
        ]
    by_ids = client.completions.create(prompt=ids, **args)
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone]
    assert by_ids.usage.prompt_tokens == prompt_tokens

    echo = client.completions.create(prompt=PROMPTS[:2], echo=True, n=2, **args)
    for c in echo.choices:  # each choice echoes its own prompt
        assert c.text == PROMPTS[c.index // 2] + alone[c.index // 2].choices[0].text
    scored = client.completions.create(prompt=PROMPTS, logprobs=1, **args)
    for c in scored.choices:
        assert "".join(c.logprobs.tokens) == c.text == alone[c.index].choices[0].text
        assert len(c.logprobs.token_logprobs) == 5


def test_a_streamed_batch_sends_every_choice_and_its_finish_and_summed_usage(client):
    args = {"model": MODEL, "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(prompt=PROMPTS, n=2, **args)
    chunks = list(
        client.completions.create(
            prompt=PROMPTS, n=2, stream=True, stream_options={"include_usage": True}, **args
        )
    )
    texts, finishes = {}, {}
    for chunk in chunks[:-1]:
        assert chunk.id == chunks[0].id and chunk.usage is None
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in finishes  # one finish per choice
                finishes[c.index] = c.finish_reason
    assert texts == _texts_by_index(whole.choices)
    assert finishes == dict.fromkeys(range(6), "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    echo = client.completions.create(prompt=PROMPTS[:2], echo=True, stream=True, **args)
    texts = {}
    for chunk in echo:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i].startswith(PROMPTS[i]) for i in (0, 1)] == [True, True]


def test_hostile_batches_are_400_naming_prompt_with_one_row_each(live, client, tenant):
    vocab = live.state.engine.input_limits.vocab_size
    long_ids = [5] * live.state.engine.max_model_len
    room = live.state.engine.max_model_len - 4  # enough for "a", not for prompt 1
    cases = [
        ({"prompt": ["a"] * 9}, "9 prompts"),  # more than max_n (8) choices
        ({"prompt": ["a", "b", "c"], "n": 3}, "prompts x n"),
        ({"prompt": [[1, 2]] * 20_000}, "20000 prompts"),
        ({"prompt": [[1, 2], long_ids]}, "prompt 1"),
        ({"prompt": [[1, 2], [3, vocab]]}, "prompt 1"),
        ({"prompt": [[1, 2], "text"]}, "mixes"),
        ({"prompt": ["text", [1, 2]]}, "mixes"),
        ({"prompt": [[1, 2], [3, "x"]]}, "prompt 1"),
        ({"prompt": []}, "empty"),
        ({"prompt": ["a", ""]}, "empty"),
        ({"prompt": [[1], []]}, "empty"),
        ({"prompt": ["a", "one two three four five six"], "max_tokens": room}, "prompt 1"),
    ]
    for body, says in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, **{"max_tokens": 2, **body})
        assert err.value.body["param"] in ("prompt", "max_tokens"), (body, err.value.body)
        assert says in err.value.body["message"], (says, err.value.body)
    rows = usage_events(live, tenant["api_key"])
    assert len(rows) == len(cases)
    assert all(r.status == "error" and r.prompt_tokens + r.completion_tokens == 0 for r in rows)


def test_a_client_leaving_a_streamed_batch_aborts_every_prompt(live, engine_client, tenant):
    body = {
        "model": MODEL,
        "prompt": PROMPTS,
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    seen = set()
    with live.client(tenant["api_key"]) as c:
        with c.stream("POST", "/v1/completions", json=body) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if '"text":"' in line:
                    seen.add(line.split('"index":')[1].split(",")[0])
                if len(seen) == 3:
                    break  # leaving the block closes the connection mid-stream
    rows = wait_for(lambda: [r for r in usage_events(live, tenant["api_key"]) if r.status != "ok"])
    assert len(rows) == 1 and (rows[0].status, rows[0].error_type) == (
        "aborted",
        "client_disconnected",
    )
    assert 3 <= rows[0].completion_tokens < 9000 and rows[0].prompt_tokens > 0
    assert wait_for(lambda: engine_client.stats()["kv_blocks_in_use"] == 0)
    assert not engine_client.core.engine_core.scheduler.requests
    assert not live.state.in_flight


def test_one_prompt_failing_mid_way_fails_the_batch_and_aborts_the_others(
    live, engine_client, tenant, client, monkeypatch
):
    runner = engine_client.core.engine_core.runner
    scheduler = engine_client.core.engine_core.scheduler
    forward = runner.forward

    def faulty(items):  # prompt 1's sequence faults once it has 3 tokens
        for item in items:
            seq = scheduler.seqs.get(item.seq_id)
            if item.seq_id.endswith("-1") and seq is not None and seq.num_output_tokens >= 3:
                raise RuntimeError("injected fault")
        return forward(items)

    monkeypatch.setattr(runner, "forward", faulty)
    args = {"model": MODEL, "max_tokens": 1000, "extra_body": {"ignore_eos": True}}
    with pytest.raises(openai.InternalServerError):
        client.completions.create(prompt=PROMPTS, **args)
    with pytest.raises(openai.APIError):
        for _ in client.completions.create(prompt=PROMPTS, stream=True, **args):
            pass
    rows = usage_events(live, tenant["api_key"])
    assert [(r.status, r.error_type) for r in rows] == [("error", "internal_error")] * 2
    # What was produced, and no more: the other prompts stopped with prompt 1, at about the
    # same length (they do not run on to their 1000 tokens).
    assert all(9 <= r.completion_tokens < 100 for r in rows), [r.completion_tokens for r in rows]
    assert wait_for(lambda: engine_client.stats()["kv_blocks_in_use"] == 0)
    assert not scheduler.requests


def test_a_batch_spends_its_summed_tokens_from_the_token_rate_limit(live, client, tenant):
    with live.client(tenant["api_key"]) as c:  # /tokenize spends no tokens
        prompt = c.post("/tokenize", json={"model": MODEL, "prompt": PROMPTS[0]}).json()["count"]
    one = prompt + 4  # one request's prompt and completion tokens
    with live.admin() as a:  # room for two such requests a minute, not for a batch of three
        r = a.put(f"/admin/tenants/{tenant['id']}/limits", json={"tokens_per_minute": 2 * one + 1})
        assert r.status_code == 200, r.text
    args = {"model": MODEL, "max_tokens": 4, "extra_body": {"ignore_eos": True}}
    batch = client.completions.create(prompt=[PROMPTS[0]] * 3, **args)
    assert batch.usage.total_tokens == 3 * one
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(prompt=PROMPTS[0], **args)
    assert "tokens_per_minute" in err.value.body["message"]
