"""Penalties, logit_bias and min_tokens against transformers' logits processors and OpenAI's
definition, batched: each row gets what it gets alone, and untouched rows stay bit-identical."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.sampling.penalties import TokenHistory, apply_logits_processors
from loraplex.engine.sampling.sampler import Sampler

V = 50
EOS = 2


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    logits = _logits(1)
    tokens = [5, 7, 7, 9, 30, 31]  # 4 prompt tokens, 2 output tokens
    params = SamplingParams(repetition_penalty=1.7)
    got = apply_logits_processors(logits, [params], [TokenHistory(tokens, 4)])
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([tokens]), logits.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_frequency_and_presence_follow_openai_over_output_only():
    logits = _logits(1)
    tokens = [5, 5, 5, 9, 9, 12, 40]  # prompt [5, 5, 5], output [9, 9, 12, 40]
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.25)
    got = apply_logits_processors(logits, [params], [TokenHistory(tokens, 3)])
    want = logits.clone()
    for tok, count in {9: 2, 12: 1, 40: 1}.items():  # mu - c * freq - (c > 0) * presence
        want[0, tok] -= count * 0.5 + 1.25
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got[0, 5] == logits[0, 5]  # a prompt token is not penalized by OpenAI's penalties


def test_negative_penalties_encourage_repeats():
    logits = torch.zeros(1, V)
    params = SamplingParams(temperature=0, frequency_penalty=-2.0)
    out = Sampler()(logits, [params], histories=[TokenHistory([1, 3], 1)])
    assert out.token_ids == [3]


def test_logit_bias_matches_transformers_sequence_bias():
    logits = _logits(1)
    bias = {3: 5.0, 17: -100.0, 49: 0.5}
    got = apply_logits_processors(logits, [SamplingParams(logit_bias=bias)], [None])
    proc = SequenceBiasLogitsProcessor(sequence_bias=[[[k], v] for k, v in bias.items()])
    want = proc(torch.tensor([[1]]), logits.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_logit_bias_plus_100_makes_every_sampled_token_that_token():
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, logit_bias={"11": 100})] * 64
    out = sampler(_logits(64, seed=3), params, histories=[None] * 64)
    assert set(out.token_ids) == {11}


def test_min_tokens_matches_transformers_then_lets_eos_through():
    logits = _logits(1)
    logits[0, EOS] = 50.0  # EOS would win
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[8])
    for n_out, blocked in ((0, True), (2, True), (3, False)):
        hist = TokenHistory([1, 4] + [6] * n_out, 2)
        got = apply_logits_processors(logits, [params], [hist], eos_token_ids=[EOS])
        want = MinNewTokensLengthLogitsProcessor(2, 3, [EOS, 8])(
            torch.tensor([hist.token_ids]), logits.clone()
        )
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert bool(torch.isinf(got[0, EOS])) is blocked
        token = Sampler(eos_token_ids=[EOS])(logits, [params], histories=[hist]).token_ids[0]
        assert (token == EOS) is not blocked


def test_min_tokens_with_ignore_eos_masks_only_stop_token_ids():
    logits = _logits(1)
    params = SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[8])
    got = apply_logits_processors(logits, [params], [TokenHistory([1], 1)], eos_token_ids=[EOS])
    assert torch.isinf(got[0, 8]) and got[0, EOS] == logits[0, EOS]


def test_a_mixed_batch_gives_each_row_what_it_gets_alone():
    logits = _logits(6, seed=7)
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.3, logit_bias={1: 2.0}),
        SamplingParams(temperature=0),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, min_tokens=4),
        SamplingParams(top_k=5),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=2.0, logit_bias={4: -3}),
    ]
    hists = [TokenHistory([1, 2, 3, 3, 4, 9], 2) for _ in params]
    together = apply_logits_processors(logits, params, hists, eos_token_ids=[EOS])
    for r in range(6):
        alone = apply_logits_processors(logits[r : r + 1], [params[r]], [hists[r]], [EOS])
        assert torch.equal(together[r], alone[0])
        if not params[r].processes_logits:
            assert torch.equal(together[r], logits[r])  # bit-identical


def test_logprobs_stay_those_of_the_raw_logits():
    logits = _logits(1)
    params = SamplingParams(temperature=0, logprobs=1, logit_bias={0: 100})
    out = Sampler()(logits, [params], histories=[None])
    assert out.token_ids == [0]
    assert out.logprobs[0] == pytest.approx(float(logits.log_softmax(-1)[0, 0]), abs=1e-5)


def test_a_row_that_needs_its_history_and_has_none_is_refused():
    with pytest.raises(ValueError, match="history"):
        apply_logits_processors(_logits(1), [SamplingParams(presence_penalty=1)], [None])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias"),
        ({"min_tokens": 17}, "min_tokens"),  # above max_tokens (16)
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_out_of_range_values_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        SamplingParams(**kwargs)


def test_a_cached_prompt_tensor_gives_the_same_logits():
    logits = _logits(2)
    tokens = [5, 7, 7, 9, 30, 31]
    params = [SamplingParams(repetition_penalty=1.5)] * 2
    plain = TokenHistory(tokens, 4)
    cached = TokenHistory(tokens, 4, torch.tensor(tokens[:4]))
    got = apply_logits_processors(logits, params, [plain, cached])
    want = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([tokens] * 2), logits.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
