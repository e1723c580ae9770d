"""Prompt logprobs over HTTP: Completions' ``echo`` with ``logprobs`` (``max_tokens: 0``
included, lm-evaluation-harness's loglikelihood request) and vLLM's ``prompt_logprobs`` on both
endpoints, through the ``openai`` SDK and raw JSON, checked against transformers' own logits
for the same token ids (float32, within 1e-4)."""

import openai
import pytest
import torch

MODEL = "tiny-llava"
TOL = 1e-4
HI = [{"role": "user", "content": "hi"}]
IDS = [1, 57, 300, 12, 905, 77, 41, 500, 8, 260, 33, 19, 700, 64, 5, 88, 123, 9, 411, 2]


@pytest.fixture
def tenant(live):
    return live.create_tenant("acme")


@pytest.fixture
def client(live, tenant):
    return live.openai(tenant["api_key"])


@pytest.fixture(scope="module")
def oracle(hf_llava):
    def logp(ids):
        with torch.no_grad():
            logits = hf_llava(input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return logp


def test_echo_logprobs_max_tokens_0_is_the_prompt_scored(live, client, tenant, oracle):
    r = client.completions.create(model=MODEL, prompt=IDS, max_tokens=0, echo=True, logprobs=2)
    (choice,) = r.choices
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(IDS)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(IDS)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text  # the echoed prompt, nothing after it
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(IDS))]
    want = oracle(IDS)
    for p in range(1, len(IDS)):
        assert abs(lp.token_logprobs[p] - want[p - 1, IDS[p]].item()) < TOL, p
        top = lp.top_logprobs[p]
        assert lp.tokens[p] in top and len(top) <= 3  # the token and its top 2 (vLLM's)
        best = want[p - 1].max().item()
        assert abs(max(top.values()) - best) < TOL
    with live.client(tenant["api_key"]) as c:
        usage = c.get("/v1/usage").json()["totals"]
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(IDS)


def test_echo_logprobs_put_the_prompt_first_then_the_completion(client, oracle):
    plain = client.completions.create(
        model=MODEL, prompt=IDS, max_tokens=3, temperature=0, logprobs=1
    )
    echo = client.completions.create(
        model=MODEL, prompt=IDS, max_tokens=3, temperature=0, logprobs=1, echo=True
    )
    lp, gen = echo.choices[0].logprobs, plain.choices[0].logprobs
    assert echo.choices[0].text.endswith(plain.choices[0].text)
    assert len(lp.tokens) == len(IDS) + 3 and lp.tokens[len(IDS) :] == gen.tokens
    assert lp.token_logprobs[len(IDS) :] == pytest.approx(gen.token_logprobs, abs=TOL)
    want = oracle(IDS)
    assert lp.token_logprobs[-4] == pytest.approx(want[-2, IDS[-1]].item(), abs=TOL)
    assert echo.usage.completion_tokens == 3
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=IDS, max_tokens=3, temperature=0, logprobs=1, echo=True,
            stream=True,
        )
    )  # fmt: skip
    first = streamed[0].choices[0]
    assert first.text == echo.choices[0].text[: len(first.text)] and first.text
    assert first.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[: len(IDS)], abs=TOL)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echo.choices[0].text


def test_vllm_prompt_logprobs_on_both_endpoints(live, tenant, oracle):
    messages = [{"role": "user", "content": "score me, please"}]
    with live.client(tenant["api_key"]) as c:
        ids = c.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
        chat = c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 3},
        )
        cmpl = c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": ids, "max_tokens": 0, "n": 2, "prompt_logprobs": 3},
        )
    assert chat.status_code == 200 and cmpl.status_code == 200, (chat.text, cmpl.text)
    body = cmpl.json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert [c["text"] for c in body["choices"]] == ["", ""]
    assert body["usage"]["completion_tokens"] == 0
    scored = body["choices"][0]["prompt_logprobs"]
    assert body["choices"][1]["prompt_logprobs"] == scored
    _close(chat.json()["prompt_logprobs"], scored)  # the same prompt, the same numbers
    assert len(scored) == len(ids) and scored[0] is None
    want = oracle(ids)
    for p in range(1, len(ids)):
        position = scored[p]
        mine = position[str(ids[p])]
        assert abs(mine["logprob"] - want[p - 1, ids[p]].item()) < TOL
        assert mine["rank"] == int((want[p - 1] > want[p - 1, ids[p]]).sum()) + 1
        assert isinstance(mine["decoded_token"], str)
        assert 3 <= len(position) <= 4
        assert sorted(v["rank"] for v in position.values())[:3] == [1, 2, 3]


def _close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert x.keys() == y.keys()
        for k in x:
            assert x[k]["rank"] == y[k]["rank"] and abs(x[k]["logprob"] - y[k]["logprob"]) < TOL
    return True


HOSTILE = [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's "whole vocabulary": unbounded
    ({"prompt_logprobs": "3"}, "prompt_logprobs"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 2.5}, "prompt_logprobs"),
    ({"prompt_logprobs": 2**70}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
]


def test_hostile_prompt_logprobs_are_400_naming_the_field(live, tenant):
    with live.client(tenant["api_key"]) as c:
        for extra, param in HOSTILE:
            for path, body in (
                ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 1}),
                ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 1}),
            ):
                if "echo" in extra and "chat" in path:
                    continue
                r = c.post(path, json={**body, **extra})
                assert r.status_code == 400, (path, extra, r.text)
                assert r.json()["error"]["param"] == param, (path, extra, r.text)


def test_chat_max_tokens_0_needs_prompt_logprobs(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=0
        )
    assert err.value.body["param"] == "max_tokens"
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=0,
        extra_body={"prompt_logprobs": 0},
    )
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == ""
    assert r.usage.completion_tokens == 0 and len(r.prompt_logprobs) == r.usage.prompt_tokens


BATCH = [IDS[:6], IDS[4:15], IDS]  # three token-id prompts of different lengths


def _legacy_close(a, b):
    assert a.tokens == b.tokens and a.text_offset == b.text_offset
    assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=TOL)
    for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True):
        assert (x is None) == (y is None) and (x is None or x == pytest.approx(y, abs=TOL))


def test_a_batch_with_echo_logprobs_scores_each_choice_on_its_own_prompt(client, oracle):
    args = {"model": MODEL, "max_tokens": 0, "echo": True, "logprobs": 2}
    batch = client.completions.create(prompt=BATCH, n=2, **args)
    alone = [client.completions.create(prompt=p, **args).choices[0] for p in BATCH]
    assert [c.index for c in batch.choices] == list(range(6))
    assert batch.usage.completion_tokens == 0
    assert batch.usage.prompt_tokens == sum(len(p) for p in BATCH)
    for index, choice in enumerate(batch.choices):  # choice i * n + j: prompt i
        one = alone[index // 2]
        assert choice.text == one.text and choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == len(BATCH[index // 2])
        _legacy_close(choice.logprobs, one.logprobs)
    want = oracle(BATCH[1])  # and the numbers are the model's
    lp = batch.choices[3].logprobs.token_logprobs
    assert lp[0] is None
    scored = [want[p - 1, t].item() for p, t in enumerate(BATCH[1]) if p]
    assert lp[1:] == pytest.approx(scored, abs=TOL)

    streamed = list(client.completions.create(prompt=BATCH, stream=True, **args))
    echoes = {}
    for chunk in streamed:
        for c in chunk.choices:
            if c.logprobs is not None and c.index not in echoes:
                echoes[c.index] = c  # the chunk that echoes the choice's prompt
    assert sorted(echoes) == [0, 1, 2]
    for i, one in enumerate(alone):
        assert echoes[i].text == one.text
        _legacy_close(echoes[i].logprobs, one.logprobs)


def test_a_batch_with_echo_logprobs_and_a_completion_keeps_each_prompts_part(client):
    args = {"model": MODEL, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    args["extra_body"] = {"ignore_eos": True}
    prompts = ["Once upon a time", "Colours of the sea: blue, green and"]
    batch = client.completions.create(prompt=prompts, **args)
    for i, p in enumerate(prompts):
        one = client.completions.create(prompt=p, **args).choices[0]
        mine = batch.choices[i]
        assert mine.text.startswith(p) and len(mine.logprobs.tokens) == len(one.logprobs.tokens)
        cut = len(one.logprobs.tokens) - 2  # the prompt's part: BOS and its tokens
        assert mine.logprobs.tokens[:cut] == one.logprobs.tokens[:cut]
        assert mine.logprobs.token_logprobs[:cut] == pytest.approx(
            one.logprobs.token_logprobs[:cut], abs=TOL
        )
        assert mine.logprobs.text_offset[cut] == len(p)  # the completion's after the echo


def test_vllm_prompt_logprobs_on_a_batch_are_each_prompts_own(live, tenant):
    body = {"model": MODEL, "max_tokens": 1, "n": 2, "prompt_logprobs": 2}
    with live.client(tenant["api_key"]) as c:
        batch = c.post("/v1/completions", json={**body, "prompt": BATCH})
        alone = [c.post("/v1/completions", json={**body, "prompt": p}) for p in BATCH]
    assert batch.status_code == 200, batch.text
    choices = batch.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for index, choice in enumerate(choices):
        scored = choice["prompt_logprobs"]
        assert len(scored) == len(BATCH[index // 2]) and scored[0] is None
        _close(scored, alone[index // 2].json()["choices"][0]["prompt_logprobs"])
