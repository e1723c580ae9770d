"""OpenAI's and vLLM's sampling parameters through the ``openai`` SDK on a live gateway: each
changes the output as its definition says, and an id outside the vocabulary is a 400."""

import openai
import pytest

from loraplex.engine.models.tiny_model import EOS_ID

MODEL = "tiny-llava"
MESSAGES = [{"role": "user", "content": "Say something."}]
TOKEN = 345  # an ordinary token of the tiny vocabulary


def _text(engine_client, token, times=1):
    return b"".join(engine_client.token_bytes([token] * times)).decode()


def test_logit_bias_plus_100_makes_every_sampled_token_that_token(client, engine_client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=1.0,
        logit_bias={str(TOKEN): 100},
        logprobs=True,
    )
    assert r.usage.completion_tokens == 8
    assert {lp.token for lp in r.choices[0].logprobs.content} == {_text(engine_client, TOKEN)}
    assert r.choices[0].message.content == _text(engine_client, TOKEN, 8)


def test_eos_stop_token_ids_ignore_eos_min_tokens(client, engine_client):
    def ask(**extra):
        r = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            extra_body=extra,
            logit_bias={str(EOS_ID): 100},
        )
        return r.choices[0].finish_reason, r.usage.completion_tokens, r.choices[0].message.content

    assert ask()[:2] == ("stop", 1)  # EOS at once
    assert ask(ignore_eos=True)[:2] == ("length", 6)
    assert ask(min_tokens=3)[:2] == ("stop", 4)  # three tokens, then EOS
    # a stop token id ends the output like EOS; its text is kept only when asked for
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logit_bias={str(TOKEN): 100},
        extra_body={"stop_token_ids": [TOKEN]},
    )
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 1)
    assert r.choices[0].message.content == ""
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logit_bias={str(TOKEN): 100},
        extra_body={"stop_token_ids": [TOKEN], "include_stop_str_in_output": True},
    )
    assert r.choices[0].message.content == _text(engine_client, TOKEN)


def test_frequency_penalty_grows_presence_penalty_does_not(client, engine_client):
    def text(**kw):
        return (
            client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=10,
                temperature=0,
                logit_bias={str(TOKEN): 10},
                extra_body={"ignore_eos": True},
                **kw,
            )
            .choices[0]
            .message.content
        )

    plain = text()
    assert plain == _text(engine_client, TOKEN, 10)
    assert text(presence_penalty=2.0) == plain  # a constant 2 does not outweigh the bias
    frequency = text(frequency_penalty=2.0)  # 2 per occurrence soon does
    assert frequency != plain and frequency.startswith(_text(engine_client, TOKEN))


def test_continuous_usage_stats_counts_every_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 7
    assert len({c.usage.prompt_tokens for c in chunks}) == 1


def test_ids_outside_the_vocabulary_are_400_naming_the_field(client):
    for extra, param in (
        ({"logit_bias": {"10000000": 5}}, "logit_bias"),
        ({"stop_token_ids": [10_000_000]}, "stop_token_ids"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=3, extra_body=extra
            )
        assert err.value.body["param"] == param, err.value.body
