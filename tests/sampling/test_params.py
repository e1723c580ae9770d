import dataclasses

import pytest

from loraplex.engine.sampling import SamplingParams


def test_defaults_match_vllm_openai():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, 0, 0)
    assert p.seed is None and p.stop == () and p.stop_token_ids == () and p.logprobs is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.greedy and not p.top_k_enabled


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5


def test_normalizes_stop_and_stop_token_ids():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=7).stop_token_ids == (7,)
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop=("a",)))


def test_greedy_and_top_k_flags():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-7).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert not SamplingParams(top_k=-1).top_k_enabled
    assert SamplingParams(top_k=5).top_k_enabled


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 9223372036854775808}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
        ({"seed": "x"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": b"x"}, "stop"),
        ({"stop": ["x" * 1025]}, "stop"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_edges_are_valid():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, logprobs=20, seed=-5)
    SamplingParams(temperature=100.0, top_p=1e-6, logprobs=0, stop=["s"] * 16)
    SamplingParams(top_k=2**31 - 1, seed=2**64 - 1, stop=["x" * 1024])
    SamplingParams(seed=-(2**63))


def test_replace_revalidates():
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(SamplingParams(), top_p=0)
