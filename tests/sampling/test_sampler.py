import math

import pytest
import torch

from loraplex.engine.sampling import (
    Sampler,
    SamplingParams,
    exponential_race,
    filter_probs,
    gather_logprobs,
    make_generator,
)

P5 = [0.4, 0.3, 0.15, 0.1, 0.05]


def kept(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The kept token set and the filtered distribution of one row."""
    x = torch.tensor([logits], dtype=torch.float32)
    probs = filter_probs(
        x,
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )[0]
    return set(torch.nonzero(probs).flatten().tolist()), probs


def logs(ps):
    return [math.log(p) for p in ps]


def test_greedy_is_argmax_with_lowest_index_ties_and_consumes_no_randomness():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1.0  # tie: the lower index wins
    gens = [make_generator(i) for i in range(6)]
    shared = make_generator(99)
    states = [g.get_state() for g in gens + [shared]]
    out = Sampler(shared)(logits, [SamplingParams(temperature=0, top_p=0.1)] * 6, gens)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 7
    assert all(torch.equal(s, g.get_state()) for s, g in zip(states, gens + [shared], strict=True))
    assert out.logprobs == [None] * 6 and out.top_logprobs == [None] * 6


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, {0, 1, 2, 3, 4}),
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 1}, {0}),
        ({"top_k": -1}, {0, 1, 2, 3, 4}),
        ({"top_k": 50}, {0, 1, 2, 3, 4}),
        ({"top_p": 0.5}, {0, 1}),
        ({"top_p": 0.75}, {0, 1, 2}),
        ({"top_p": 0.3}, {0}),  # the top token always survives
        ({"top_p": 0.9}, {0, 1, 2, 3}),
        ({"min_p": 0.5}, {0, 1}),  # p >= 0.2
        ({"min_p": 0.3}, {0, 1, 2}),  # p >= 0.12
        ({"min_p": 1.0}, {0}),
        ({"top_k": 3, "top_p": 0.6}, {0, 1}),
        ({"top_k": 2, "top_p": 0.5}, {0}),  # top-p sees the top-k renormalized distribution
        ({"top_k": 4, "min_p": 0.3}, {0, 1, 2}),
        ({"top_p": 0.75, "min_p": 0.5}, {0, 1}),
        ({"temperature": 0.5, "top_p": 0.6}, {0, 1}),  # sharpened: 0.4^2/s = .53, .3^2/s = .30
        ({"temperature": 2.0, "min_p": 0.6}, {0, 1, 2}),  # flattened: sqrt ratios
    ],
)
def test_filter_kept_sets(kwargs, expected):
    got, probs = kept(logs(P5), **kwargs)
    assert got == expected
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)
    # Kept tokens keep their relative weights.
    t = kwargs.get("temperature", 1.0)
    ref = torch.tensor([P5[i] ** (1 / t) if i in expected else 0.0 for i in range(5)])
    assert torch.allclose(probs, ref / ref.sum(), atol=1e-6)


def test_filters_order_insensitive_to_vocab_position():
    perm = [3, 0, 4, 2, 1]
    got, _ = kept([math.log(P5[i]) for i in perm], top_p=0.5)
    assert {perm[i] for i in got} == {0, 1}


def test_top_k_keeps_ties_at_kth_value():
    assert kept([1.0, 1.0, 1.0, 0.0], top_k=2)[0] == {0, 1, 2}
    assert kept([2.0, 1.0, 1.0, 0.0], top_k=2)[0] == {0, 1, 2}
    assert kept([0.0, 1.0, 1.0, 1.0], min_p=1.0)[0] == {1, 2, 3}


def test_top_p_ties_broken_by_lower_index():
    assert kept([0.0, 0.0, 0.0, 0.0], top_p=0.3)[0] == {0, 1}
    assert kept([0.0, 0.0, 0.0, 0.0], top_p=0.2)[0] == {0}


def test_batched_rows_filter_independently():
    x = torch.tensor([logs(P5)] * 4)
    probs = filter_probs(
        x,
        torch.tensor([1.0, 1.0, 1.0, 1.0]),
        torch.tensor([2, 0, 0, 0]),
        torch.tensor([1.0, 0.5, 1.0, 1.0]),
        torch.tensor([0.0, 0.0, 0.3, 0.0]),
    )
    sets = [set(torch.nonzero(r).flatten().tolist()) for r in probs]
    assert sets == [{0, 1}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3, 4}]
    assert torch.equal(probs[3], torch.tensor([logs(P5)]).softmax(-1)[0])


def test_unfiltered_row_is_bit_identical_in_a_filtered_batch():
    torch.manual_seed(3)
    x = torch.randn(3, 300)
    alone = filter_probs(x[:1], torch.tensor([0.7]))
    batch = filter_probs(
        x,
        torch.tensor([0.7, 1.0, 2.0]),
        top_k=torch.tensor([0, 5, 0]),
        top_p=torch.tensor([1.0, 1.0, 0.4]),
        min_p=torch.tensor([0.0, 0.2, 0.0]),
    )
    assert torch.equal(batch[0], alone[0])
    assert torch.equal(alone[0], (x[0] / 0.7).softmax(-1))


def test_negative_infinity_logits_are_never_sampled():
    x = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]] * 2000)
    out = Sampler(make_generator(3))(x, [SamplingParams(top_p=0.99)] * 2000)
    assert set(out.token_ids) == {0, 2}


def chi_square(counts, probs):
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": 1.0}, {"temperature": 0.5}, {"temperature": 2.0}, {"top_k": 3}],
)
def test_sampled_frequencies_match_distribution(kwargs):
    logits = torch.tensor(logs(P5))
    t = kwargs.get("temperature", 1.0)
    target = (logits / t).softmax(-1)
    if "top_k" in kwargs:
        target[kwargs["top_k"] :] = 0
        target /= target.sum()
    n = 20000
    out = Sampler(make_generator(1234))(logits.expand(n, 5), [SamplingParams(**kwargs)] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).tolist()
    assert all(c == 0 for c, p in zip(counts, target.tolist(), strict=True) if p == 0)
    # df <= 4; chi2(4) critical value at p = 1e-4 is 23.5 (the generator is seeded: no flakes).
    assert chi_square(counts, target.tolist()) < 23.5, counts


def test_seeded_frequencies_match_distribution():
    # One seeded generator drawn step after step is a proper sampler too.
    logits = torch.tensor([logs(P5)])
    gen = make_generator(7)
    sampler = Sampler()
    toks = [sampler(logits, [SamplingParams()], [gen]).token_ids[0] for _ in range(2000)]
    counts = torch.bincount(torch.tensor(toks), minlength=5).tolist()
    assert chi_square(counts, P5) < 23.5, counts


def run_steps(sampler, step_logits, params, gens, row):
    return [sampler(lg, params, gens).token_ids[row] for lg in step_logits]


def test_same_seed_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    vocab, steps = 1000, 12
    target_logits = [torch.randn(vocab) * 2 for _ in range(steps)]
    others = [torch.randn(4, vocab) * 3 for _ in range(steps)]
    target = SamplingParams(seed=42, temperature=0.9)
    alone = run_steps(
        Sampler(), [lg[None] for lg in target_logits], [target], [make_generator(42)], 0
    )

    # Batch of 5, target at position 3, neighbours: greedy, seeded, unseeded with filters.
    neighbours = [
        SamplingParams(temperature=0),
        SamplingParams(seed=42, top_p=0.5),  # same seed, other params: its own generator
        SamplingParams(top_k=5, min_p=0.1),
        SamplingParams(seed=7, temperature=1.5),
    ]
    params = neighbours[:3] + [target] + neighbours[3:]
    gens = [None, make_generator(42), None, make_generator(42), make_generator(7)]
    pairs = list(zip(target_logits, others, strict=True))
    batched = [torch.cat([o[:3], t[None], o[3:]]) for t, o in pairs]
    in_batch = run_steps(Sampler(make_generator(5)), batched, params, gens, 3)
    assert in_batch == alone

    # Another composition and order: position 0 of a batch of 2, with a top-p neighbour.
    params2 = [target, SamplingParams(top_p=0.3)]
    batched2 = [torch.stack([t, o[0]]) for t, o in pairs]
    in_batch2 = run_steps(Sampler(), batched2, params2, [make_generator(42), None], 0)
    assert in_batch2 == alone


def test_same_seed_in_one_batch_gives_same_tokens_and_other_seeds_differ():
    logits = torch.zeros(4, 5000)
    params = [SamplingParams(seed=s) for s in (1, 1, 2, 3)]
    gens = [make_generator(p.seed) for p in params]
    out = Sampler()(logits, params, gens).token_ids
    assert out[0] == out[1]
    assert len({out[0], out[2], out[3]}) == 3


def test_unseeded_rows_differ():
    logits = torch.zeros(8, 5000)
    out = Sampler(make_generator(0))(logits, [SamplingParams()] * 8)
    assert len(set(out.token_ids)) >= 7
    # ... and from step to step.
    again = Sampler(make_generator(0))
    seq = [again(logits[:1], [SamplingParams()]).token_ids[0] for _ in range(8)]
    assert len(set(seq)) >= 7


def test_exponential_race_survives_zero_noise(monkeypatch):
    probs = torch.tensor([[0.0, 1.0, 0.0]])
    assert exponential_race(probs, [None]).tolist() == [1]


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.3, top_k=3, logprobs=0, seed=1),
        SamplingParams(),
        SamplingParams(temperature=2.0, top_p=0.5, logprobs=20, seed=2),
    ]
    gens = [None, make_generator(1), None, make_generator(2)]
    out = Sampler()(logits, params, gens)
    ref = torch.log_softmax(logits, dim=-1)
    for r in (0, 1, 3):
        tok = out.token_ids[r]
        assert out.logprobs[r] == pytest.approx(ref[r, tok].item(), abs=1e-6)
        assert out.ranks[r] == int((ref[r] > ref[r, tok]).sum()) + 1
    assert out.logprobs[2] is None and out.ranks[2] is None and out.top_logprobs[2] is None
    assert out.ranks[0] == 1
    assert out.top_logprobs[1] == []
    for r, k in ((0, 5), (3, 20)):
        top = out.top_logprobs[r]
        assert len(top) == k
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        ref_v, ref_i = ref[r].topk(k)
        assert [t for t, _ in top] == ref_i.tolist()
        assert values == pytest.approx(ref_v.tolist(), abs=1e-6)


def test_gather_logprobs_caps_top_at_vocab():
    lps, ranks, tops = gather_logprobs(torch.zeros(1, 3), torch.tensor([2]), [20])
    assert len(tops[0]) == 3 and ranks == [1]
    assert lps[0] == pytest.approx(-math.log(3))


@pytest.mark.parametrize("num_top", [[0], [0, None], [None, 0, 3], [0, 0], [20, 0, None]])
def test_gather_logprobs_with_no_alternatives(num_top):
    # top_logprobs 0 (or logprobs without top_logprobs): the sampled token's logprob, no
    # alternatives; rows asking for some still get theirs.
    logits = torch.randn(len(num_top), 7)
    tokens = torch.arange(len(num_top))
    lps, ranks, tops = gather_logprobs(logits, tokens, num_top)
    for r, k in enumerate(num_top):
        if k is None:
            assert (lps[r], ranks[r], tops[r]) == (None, None, None)
            continue
        expected = torch.log_softmax(logits[r], -1)
        assert lps[r] == pytest.approx(expected[r].item())
        assert len(tops[r]) == min(k, 7)
        assert [t for t, _ in tops[r]] == expected.topk(min(k, 7)).indices.tolist()


def test_sampler_with_huge_top_k_keeps_every_token():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    params = [SamplingParams(top_k=2**31 - 1, seed=1)]
    out = Sampler()(logits, params, [make_generator(1)])
    assert out.token_ids[0] in (0, 1, 2)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(5), [SamplingParams()])
    with pytest.raises(ValueError, match="params"):
        Sampler()(torch.zeros(2, 5), [SamplingParams()])


def test_half_precision_logits_are_accepted():
    out = Sampler()(torch.randn(3, 10).half(), [SamplingParams(temperature=0, logprobs=1)] * 3)
    assert len(out.token_ids) == 3 and all(lp <= 0 for lp in out.logprobs)


def test_default_generator_per_call_overrides_the_constructors():
    logits = torch.zeros(3, 1000)
    params = [SamplingParams()] * 3
    a = Sampler(make_generator(1))(logits, params, default_generator=make_generator(9))
    b = Sampler()(logits, params, default_generator=make_generator(9))
    c = Sampler(make_generator(9))(logits, params)
    assert a.token_ids == b.token_ids == c.token_ids
