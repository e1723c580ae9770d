"""Speculative decoding (issue 17): the n-gram proposer, acceptance, the adaptive count, and
the engine with speculation on giving the same tokens as without it (greedy and seeded),
with the KV cache giving back every rejected slot."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.sampling.sampler import Sampler, filter_probs
from loraplex.engine.spec_decode import AdaptiveK, NgramProposer, accepted_prefix
from loraplex.engine.spec_decode.adaptive import MAX_BACKOFF
from loraplex.engine.structured_output.grammar import StructuredOutputSpec

from .conftest import long_text, spec_flags

NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


# ------------------------------------------------------------------------------ proposer
def reference_propose(tokens, k, min_n, max_n):
    """Plain-Python prompt lookup: the most recent earlier occurrence of the longest suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                out = []
                for i in range(k):
                    idx = start + n + i
                    out.append(tokens[idx] if idx < length else out[idx - length])
                return out
    return []


def test_ngram_proposes_what_followed_the_longest_most_recent_match():
    p = NgramProposer(min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # suffix [6, 7] (3-gram [2, 6, 7] has no earlier match): most recent is at 5 -> 9, 2, 6
    assert p.propose("s", tokens, 3) == [9, 2, 6]
    assert p.propose("s", tokens + [9], 2) == [2, 6]  # [6, 7, 9] matches at 5
    assert p.propose("t", [1, 2, 3, 4], 3) == []  # nothing repeats
    assert p.propose("t", [1, 2, 3, 4], 0) == []


def test_ngram_copies_a_short_cycle_past_its_own_end():
    p = NgramProposer(min_n=2, max_n=2)
    assert p.propose("s", [9, 4, 5, 4, 5], 5) == [4, 5, 4, 5, 4]


def test_ngram_ignores_matches_across_token_boundaries():
    # 0x00000100 followed by 0x00000002 holds the bytes of 0x00020000 at a misaligned offset.
    p = NgramProposer(min_n=1, max_n=1)
    assert p.propose("s", [0x100, 2, 7, 0x20000], 2) == []
    assert p.propose("t", [0x20000, 3, 0x100, 2, 7, 0x20000], 2) == [3, 0x100]


def test_ngram_buffer_follows_the_sequence_and_is_dropped():
    p = NgramProposer(min_n=1, max_n=2)
    tokens = [3, 4, 3]
    assert p.propose("s", tokens, 1) == [4]
    tokens += [8, 3]
    assert p.propose("s", tokens, 1) == [8]  # appended, not rebuilt
    assert p.propose("s", [1, 3, 1], 1) == [3]  # shorter: rolled back, rebuilt
    p.drop("s")
    assert "s" not in p._buffers
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    k=st.integers(0, 6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_ngram_matches_the_plain_python_reference(tokens, k, min_n, extra):
    proposer = NgramProposer(min_n=min_n, max_n=min_n + extra)
    assert proposer.propose("s", tokens, k) == reference_propose(tokens, k, min_n, min_n + extra)


# ---------------------------------------------------------------------------- acceptance
def test_accepted_prefix():
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_prefix([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_prefix([4, 5, 6], [1, 5, 6, 7]) == 0
    assert accepted_prefix([], [3]) == 0
    with pytest.raises(ValueError):
        accepted_prefix([1, 2], [1, 2])


def test_adaptive_k_drops_to_zero_backs_off_and_recovers():
    ctl = AdaptiveK(max_k=4)
    assert ctl.next_k() == 2  # prior alpha 0.5
    for _ in range(6):
        ctl.update(ctl.max_k, ctl.max_k)  # everything accepted
    assert ctl.next_k() == 4
    for _ in range(12):
        ctl.update(1, 0)  # everything rejected
    ks = [ctl.next_k() for _ in range(200)]
    probes = [i for i, k in enumerate(ks) if k]
    assert all(ks[i] == 1 for i in probes)  # a probe is one proposal
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:7] == [1, 2, 4, 8, 16, 32, 64] and max(gaps) == MAX_BACKOFF
    for _ in range(10):  # acceptance came back: probes are accepted, k grows again
        ctl.update(1, 1)
    ctl.wait = 0
    assert ctl.next_k() >= 3


def test_verification_keeps_the_target_distribution():
    """Chi-square: the first two tokens of a speculating sequence follow p0(a) * p1(b | a).

    One proposal ``x`` is verified: rows ``[p0, p1(. | x)]`` are sampled as the engine does
    (temperature, top-k, the exponential race) and ``t0 .. t_a`` kept; when ``x`` was rejected,
    the second token comes from the next plain step, ``p1(. | t0)``.
    """
    vocab, trials, x = 6, 30000, 2
    gen = torch.Generator().manual_seed(7)
    logits0 = torch.randn(vocab, generator=gen)
    logits1 = torch.randn(vocab, vocab, generator=gen)  # row a: logits after token a
    params = SamplingParams(temperature=0.8, top_k=5)
    sampler = Sampler(torch.Generator().manual_seed(0))

    def probs(logits):
        return filter_probs(logits.view(1, -1), torch.tensor([0.8]), torch.tensor([5]))[0]

    rows = torch.stack([logits0, logits1[x]]).repeat(trials, 1)
    tokens = sampler(rows, [params] * (2 * trials)).token_ids
    pairs, rejected_firsts = [], []
    for i in range(trials):
        t0, t1 = tokens[2 * i], tokens[2 * i + 1]
        if accepted_prefix([x], [t0, t1]) == 1:
            pairs.append((t0, t1))
        else:
            rejected_firsts.append(t0)
    seconds = sampler(logits1[rejected_firsts], [params] * len(rejected_firsts)).token_ids
    pairs += list(zip(rejected_firsts, seconds, strict=True))
    assert 0 < len(rejected_firsts) < trials  # both branches were taken
    p0 = probs(logits0)
    expected = torch.stack([p0[a] * probs(logits1[a]) for a in range(vocab)]).flatten()
    observed = torch.zeros(vocab * vocab)
    for a, b in pairs:
        observed[a * vocab + b] += 1
    keep = expected > 0
    assert observed[~keep].sum() == 0  # nothing the filters drop is ever produced
    _, pvalue = chisquare(observed[keep].numpy(), (expected[keep] * trials).numpy())
    assert pvalue > 1e-3


# -------------------------------------------------------------------------------- engine
def outputs(llm, requests):
    outs = llm.generate(requests)
    return [[(o.token_ids, o.finish_reason) for o in out.outputs] for out in outs]


def build(llm, prompts, params):
    return [
        llm.make_request([{"role": "user", "content": p}], sp, request_id=f"r{i}")
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]


PROMPTS = [long_text(40, seed=21), "hello hello hello", long_text(120, seed=22), "why? why?"]


def mixed_params():
    return [
        SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=70, ignore_eos=True, logprobs=2),
        SamplingParams(
            temperature=0.7,
            seed=4,
            max_tokens=80,
            n=3,
            ignore_eos=True,
            frequency_penalty=0.5,
            repetition_penalty=1.2,
        ),
        SamplingParams(temperature=0.0, max_tokens=64, min_tokens=20, logit_bias={7: 3.0}),
    ]


@pytest.fixture(params=["ngram", "draft"])
def flags(request, tiny_text_dir, tmp_path_factory):
    """Speculation flags: n-gram (up to 4 proposals) or the 2-layer draft (up to 3)."""
    if request.param == "ngram":
        return NGRAM
    return spec_flags("draft", tiny_text_dir, tmp_path_factory)


def test_seeded_and_greedy_outputs_are_the_same_with_speculation(tiny_text_dir, flags):
    plain = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=256))
    spec = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=256, **flags))
    expected = outputs(plain, build(plain, PROMPTS, mixed_params()))
    got = outputs(spec, build(spec, PROMPTS, mixed_params()))
    assert got == expected
    stats = spec.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] >= 3  # it did speculate, and kept some
    assert stats["spec_decode_num_drafts"] < sum(len(t) for o in got for t, _ in o)
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # position i+1 needs position i
    assert spec.engine.kv.pool.num_used == 0


def test_logprobs_are_those_of_plain_decoding(tiny_text_dir, flags):
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=3)]
    runs = []
    for kw in ({}, flags):
        llm = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=64, **kw))
        runs.append(llm.generate(build(llm, ["hello hello hello"], params))[0].outputs[0])
    assert runs[0].token_ids == runs[1].token_ids
    for (lp0, top0), (lp1, top1) in zip(runs[0].logprobs, runs[1].logprobs, strict=True):
        assert lp0 == pytest.approx(lp1, abs=1e-4)
        assert [t for t, _ in top0] == [t for t, _ in top1]


def test_stop_strings_stop_tokens_and_max_tokens_cut_inside_accepted_runs(tiny_text_dir, flags):
    plain = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=64))
    first = plain.generate(build(plain, ["hello hello hello"], [mixed_params()[0]]))[0]
    ids = first.outputs[0].token_ids
    text = first.outputs[0].text
    params = [
        SamplingParams(temperature=0.0, max_tokens=90, stop=(text[len(text) // 2 :][:6],)),
        SamplingParams(temperature=0.0, max_tokens=90, stop_token_ids=(ids[50],)),
        SamplingParams(temperature=0.0, max_tokens=57, ignore_eos=True),
    ]
    prompts = ["hello hello hello"] * 3
    results = []
    for kw in ({}, flags):
        llm = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=64, **kw))
        outs = llm.generate(build(llm, prompts, params))
        results.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                        for o in outs])  # fmt: skip
        assert llm.engine.kv.pool.num_used == 0
    assert results[0] == results[1]
    assert len(results[1][2][1]) == 57 and results[1][2][2] == "length"
    assert results[1][1][2] == "stop" and results[1][0][2] == "stop"


def test_every_step_keeps_exactly_the_blocks_of_its_computed_tokens(tiny_text_dir, flags):
    llm = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=128, block_size=4, **flags))
    engine = llm.engine
    for req in build(llm, PROMPTS, mixed_params()):
        engine.add_request(req)
    bs, steps = engine.kv.block_size, 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for seq in engine.scheduler.running:
            if seq.num_computed_tokens == seq.num_tokens - 1:  # decoding
                held = engine.kv.num_blocks_of(seq.seq_id)
                assert held == -(-seq.num_computed_tokens // bs), seq.seq_id
                runner = engine.runner.seqs.get(seq.seq_id)  # a fork child: next step
                if runner is not None:
                    assert runner.table.block_ids == engine.kv.get_block_ids(seq.seq_id)
    stats = engine.scheduler.spec_stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # rejections were trimmed
    assert engine.kv.pool.num_used == 0 and steps > 0


def test_structured_output_rows_speculate_within_their_grammar(tiny_text_dir):
    """n-gram proposals the grammar allows are verified under each position's bitmask; the
    outputs are those of plain decoding and valid against their schemas."""
    import jsonschema

    array = {
        "type": "array",
        "items": {"enum": ["alpha", "beta", "gamma"]},
        "minItems": 3,
        "maxItems": 40,
    }
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    json_array = StructuredOutputSpec.json_schema(array)
    json_obj = StructuredOutputSpec.json_schema(obj)
    params = [
        SamplingParams(temperature=0.0, max_tokens=200, structured_output=json_array),
        SamplingParams(temperature=0.8, seed=5, max_tokens=200, structured_output=json_array),
        SamplingParams(temperature=0.0, max_tokens=60, structured_output=json_obj),
        SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True),
    ]
    prompts = ["list please", "more of them", "json please", "hello hello hello"]
    runs = []
    for kw in ({}, NGRAM):
        llm = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=128, **kw))
        runs.append(llm.generate(build(llm, prompts, params)))
        assert llm.engine.kv.pool.num_used == 0
    plain, spec = ([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in r] for r in runs)
    assert spec == plain
    for out, schema in zip(runs[1][:3], (array, array, obj), strict=True):
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    stats = llm.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 10


def test_config_checks_the_speculative_flags(tiny_text_dir):
    assert EngineConfig(model="m").spec_k == 0
    assert EngineConfig(model="m", speculative_method="ngram").spec_k == 4
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(model="m", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(model="m", speculative_method="ngram", num_speculative_tokens=17)
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(model="m", speculative_method="eagle")
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(model="m", speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(model="m", speculative_method="ngram", speculative_model="d")
    with pytest.raises(ValueError, match="prompt_lookup"):
        EngineConfig(
            model="m", speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2
        )


def test_a_failing_draft_costs_the_step_its_speculation_only(tiny_text_dir, tmp_path_factory):
    flags = spec_flags("draft", tiny_text_dir, tmp_path_factory)
    plain = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=256))
    spec = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=256, **flags))
    draft = spec.engine.runner.draft
    calls = {"n": 0}
    forward = draft.model.forward

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("draft fault")
        return forward(*args, **kwargs)

    draft.model.forward = flaky
    expected = outputs(plain, build(plain, PROMPTS, mixed_params()))
    assert outputs(spec, build(spec, PROMPTS, mixed_params())) == expected
    assert calls["n"] >= 6 and spec.engine.kv.pool.num_used == 0


def test_the_draft_runs_only_in_steps_that_speculate(tiny_text_dir, tmp_path_factory):
    flags = spec_flags("draft", tiny_text_dir, tmp_path_factory)
    llm = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=128, **flags))
    draft = llm.engine.runner.draft
    calls = []
    forward = draft.model.forward
    draft.model.forward = lambda *a, **kw: calls.append(1) or forward(*a, **kw)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured_output=StructuredOutputSpec.json_schema(schema)
    )
    llm.generate(build(llm, ["json please"], [params]))  # structured rows never speculate
    assert calls == []
    llm.generate(build(llm, ["hello hello hello"], [mixed_params()[0]]))
    assert calls


def test_drafts_that_cannot_propose_for_the_target_are_refused(
    tiny_text_dir, tiny_llava_dir, tmp_path
):
    from loraplex.engine.spec_decode.layer_skip import write_layer_skip_draft

    with pytest.raises(ValueError, match="text-only"):
        LLM(EngineConfig(model=tiny_text_dir, speculative_method="draft",
                         speculative_model=tiny_llava_dir))  # fmt: skip
    other = write_layer_skip_draft(tiny_text_dir, tmp_path / "other", 1)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="positions"):
        LLM(EngineConfig(model=tiny_text_dir, speculative_method="draft",
                         speculative_model=str(other)))  # fmt: skip
    with pytest.raises(ValueError, match="speculative model"):
        LLM(EngineConfig(model=tiny_text_dir, speculative_method="draft",
                         speculative_model=str(tmp_path / "missing")))  # fmt: skip
    with pytest.raises(ValueError, match="num_layers"):
        write_layer_skip_draft(tiny_text_dir, tmp_path / "x", 0)


def test_adaptive_k_gives_up_after_failed_probes_when_asked():
    ctl = AdaptiveK(max_k=4, max_failed_probes=3)
    ks = []
    for _ in range(300):
        k = ctl.next_k()
        ks.append(k)
        if k:
            ctl.update(k, 0)
    assert ctl.failed_probes == 3 and sum(ks) <= 8 and not any(ks[20:])
    ctl = AdaptiveK(max_k=4, max_failed_probes=3)  # an accepted probe resets the count
    for _ in range(200):
        k = ctl.next_k()
        if k:
            ctl.update(k, k if ctl.failed_probes == 2 else 0)
    assert ctl.failed_probes < 3


def test_the_draft_catch_up_of_a_step_is_bounded(tiny_text_dir, tmp_path_factory):
    """Long prompts starting to speculate in one step: no draft forward computes more than the
    step's token budget; the sequences left behind run plain decodes meanwhile."""
    flags = spec_flags("draft", tiny_text_dir, tmp_path_factory)
    config = {"model": tiny_text_dir, "num_kv_blocks": 256, "max_num_batched_tokens": 48}
    plain = LLM(EngineConfig(**config))
    spec = LLM(EngineConfig(**config, **flags))
    draft = spec.engine.runner.draft
    sizes = []
    forward = draft.model.forward
    draft.model.forward = lambda ids, *a, **kw: sizes.append(len(ids)) or forward(ids, *a, **kw)
    prompts = [long_text(90, seed=30 + i) for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 3
    expected = outputs(plain, build(plain, prompts, params))
    assert outputs(spec, build(spec, prompts, params)) == expected
    assert max(sizes) <= 48 < sum(sizes)
    assert spec.engine.stats()["spec_decode_num_drafts"] > 0


@pytest.mark.slow  # two engines' start-up (about 2 s)
def test_a_draft_identical_to_the_target_is_always_accepted_after_a_bounded_catch_up(
    tiny_text_dir,
):
    """The target as its own draft, greedy, prompts longer than the step's budget: the first
    catch-up of each does not fit one step, and every proposal after it must be accepted (a
    step left undrafted once marked positions its catch-up had not reached as valid draft KV,
    so the draft attended over zeros and about half its proposals were rejected)."""
    config = EngineConfig(
        model=tiny_text_dir,
        num_kv_blocks=256,
        max_num_batched_tokens=16,
        speculative_method="draft",
        speculative_model=tiny_text_dir,
        num_speculative_tokens=3,
    )
    llm = LLM(config)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate(build(llm, [long_text(30, seed=40)], [params]))
    stats = llm.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 8
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
