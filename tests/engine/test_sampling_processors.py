"""Penalties, logit_bias and min_tokens in the engine: greedy tokens equal transformers'
``generate`` with its own logits processors, and a batch mixing every processor with plain
requests gives each request what it gives alone."""

import pytest
import torch

from loraplex.engine.sampling.params import SamplingParams

from .conftest import long_text, spec_flags


@pytest.fixture(scope="module", params=["no-spec", "ngram", "draft"])
def llm(tiny_text_dir, request, tmp_path_factory, make_llm):
    """The engine, plain and with speculative decoding.

    Each verified position's penalties see the proposals before it as output.
    """
    spec = spec_flags(request.param, tiny_text_dir, tmp_path_factory)
    return make_llm(model=tiny_text_dir, num_kv_blocks=128, **spec)


PROMPTS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "user", "content": long_text(60, seed=11)}],
    [{"role": "user", "content": long_text(25, seed=12) + " again and again"}],
]


def _hf(hf_text, messages, max_tokens, **kwargs):
    model, tokenizer = hf_text
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, **kwargs)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _run(llm, messages, **kwargs):
    params = SamplingParams(temperature=0, **kwargs)
    return llm.generate([llm.make_request(messages, params)])[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "ours, theirs",
    [
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        ({"repetition_penalty": 0.6}, {"repetition_penalty": 0.6}),
        ({"logit_bias": {7: 4.0, 19: -100.0}}, {"sequence_bias": {(7,): 4.0, (19,): -100.0}}),
    ],
)
def test_greedy_tokens_equal_transformers_processors(llm, hf_text, ours, theirs):
    changed = 0
    for messages in PROMPTS:
        want = _hf(hf_text, messages, 12, **theirs)
        got = _run(llm, messages, max_tokens=12, **ours)
        assert got == want
        changed += got != _run(llm, messages, max_tokens=12)
    assert changed  # the oracle agrees on outputs the processor changed


def test_min_tokens_holds_back_eos_like_transformers(llm, hf_text):
    eos = sorted(llm.engine.core.eos_token_ids)[0]
    messages = PROMPTS[0]
    bias = {eos: 30.0}  # EOS first, unless min_tokens holds it back
    want = _hf(hf_text, messages, 10, sequence_bias={(eos,): 30.0}, min_new_tokens=5)
    got = _run(llm, messages, max_tokens=10, logit_bias=bias, min_tokens=5)
    assert got == want and len(got) == 6 and got[-1] == eos
    assert _run(llm, messages, max_tokens=10, logit_bias=bias) == [eos]


def test_presence_and_frequency_penalties_change_repeats_as_defined(llm):
    messages = PROMPTS[2]
    bias = {42: 10.0}  # token 42 wins every step unless a penalty outweighs the bias
    kw = {"max_tokens": 12, "ignore_eos": True, "logit_bias": bias}
    assert _run(llm, messages, **kw) == [42] * 12
    # presence: a constant 2 once 42 has appeared, which the bias still outweighs
    assert _run(llm, messages, presence_penalty=2.0, **kw) == [42] * 12
    # frequency: 2 per occurrence, so 42 loses once it has appeared a few times
    frequent = _run(llm, messages, frequency_penalty=2.0, **kw)
    assert 1 <= frequent.count(42) < 12 and frequent[0] == 42


def test_a_batch_mixing_every_processor_gives_each_request_what_it_gives_alone(llm):
    eos = sorted(llm.engine.core.eos_token_ids)[0]
    kinds = [
        SamplingParams(max_tokens=10, temperature=0),
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.4),
        SamplingParams(
            max_tokens=10, temperature=0.8, seed=3, presence_penalty=1.5, frequency_penalty=0.5
        ),
        SamplingParams(max_tokens=10, temperature=1.0, seed=4),
        SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 30.0}, min_tokens=3),
        SamplingParams(
            max_tokens=10,
            temperature=0.7,
            seed=5,
            logit_bias={5: 3.0},
            stop_token_ids=[9],
            min_tokens=2,
            ignore_eos=True,
            n=2,
        ),
        SamplingParams(
            max_tokens=10,
            temperature=0,
            stop_token_ids=[9],
            include_stop_str_in_output=True,
            min_p=0.1,
        ),
    ]
    alone = []
    for i, params in enumerate(kinds):
        req = llm.make_request(PROMPTS[i % 3], params, request_id=f"alone{i}")
        alone.append([o.token_ids for o in llm.generate([req])[0].outputs])
    batch = [
        llm.make_request(PROMPTS[i % 3], p, request_id=f"mixed{i}") for i, p in enumerate(kinds)
    ]
    together = [[o.token_ids for o in out.outputs] for out in llm.generate(batch[::-1])][::-1]
    assert together == alone
    assert alone[4][0][-1] == eos and len(alone[4][0]) == 4
