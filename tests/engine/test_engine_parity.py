"""Greedy token parity with transformers (float32, CPU) for mixed continuous batches.

The oracle runs each request alone through ``transformers`` ``generate``; the engine runs them
all in one continuous batch over the paged cache, under several schedules: plain, chunked
prefill forced small, a second run hitting the prefix cache, a tiny pool forcing preemption
(recompute and swap), and the batch submitted in another order.
"""

import base64
import io

import pytest
import torch
from PIL import Image

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.sampling.params import SamplingParams

from .conftest import long_text, photo, spec_used, user

pytestmark = pytest.mark.slow


def to_hf_messages(messages):
    """image_url data URLs -> the template's image parts with the decoded PIL image."""
    out = []
    for m in messages:
        parts = []
        for p in m["content"]:
            if p["type"] == "image_url":
                raw = base64.b64decode(p["image_url"]["url"].split(",", 1)[1])
                parts.append({"type": "image", "image": Image.open(io.BytesIO(raw)).convert("RGB")})
            else:
                parts.append(p)
        out.append({"role": m["role"], "content": parts})
    return out


def llava_batch():
    astro, cat, coffee = photo("astronaut"), photo("chelsea"), photo("coffee")
    shared = long_text(520, seed=1)
    return [
        (user("hi"), 6),
        (user(shared + " first question?"), 12),
        (user("what is this?", astro), 9),
        (user("compare", astro, "with", cat), 15),
        (user(cat, long_text(270, seed=2)), 7),
        (user(long_text(115, seed=3)), 20),
        (user(shared + " second question, different"), 11),
        (user("and this one?", coffee, "again", astro), 4),
        (user("a rocket", photo("rocket")), 13),
    ]


def text_batch():
    shared = long_text(510, seed=4)
    return [
        ([{"role": "user", "content": "hello"}], 8),
        ([{"role": "user", "content": shared + " tell me more"}], 16),
        ([{"role": "user", "content": long_text(65, seed=5)}], 5),
        ([{"role": "user", "content": shared + " and then?"}], 12),
        ([{"role": "user", "content": long_text(230, seed=6)}], 20),
        ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}], 9),
        ([{"role": "user", "content": long_text(200, seed=7)}], 3),
        ([{"role": "user", "content": long_text(18, seed=8)}], 14),
    ]


def hf_greedy(model, processor, messages, max_tokens, multimodal):
    msgs = to_hf_messages(messages) if multimodal else messages
    inputs = processor.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def llava_oracle(hf_llava):
    model, processor = hf_llava
    return [hf_greedy(model, processor, m, k, True) for m, k in llava_batch()]


@pytest.fixture(scope="session")
def text_oracle(hf_text):
    model, tokenizer = hf_text
    return [hf_greedy(model, tokenizer, m, k, False) for m, k in text_batch()]


def run_batch(llm, batch, order=None, tag="r"):
    order = order if order is not None else list(range(len(batch)))
    reqs = {}
    for i in order:
        messages, max_tokens = batch[i]
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        reqs[i] = llm.make_request(messages, sampling, request_id=f"{tag}-{i}")
    outs = llm.generate([reqs[i] for i in order])
    by_index = dict(zip(order, outs, strict=True))
    return [by_index[i] for i in range(len(batch))]


def check(outputs, oracle):
    lengths = []
    for i, (out, (prompt, expected)) in enumerate(zip(outputs, oracle, strict=True)):
        assert out.prompt_token_ids == prompt, f"request {i}: prompt tokens differ"
        assert out.outputs[0].token_ids == expected, f"request {i}: generated tokens differ"
        lengths.append(len(prompt))
    return lengths


def config(model_dir, **kw):
    return EngineConfig(model=model_dir, **kw)


def test_oracle_batch_has_the_required_spread(llava_oracle, text_oracle):
    for oracle in (llava_oracle, text_oracle):
        lengths = [len(p) for p, _ in oracle]
        assert min(lengths) <= 40 and 550 <= max(lengths) <= 700
        assert len(oracle) >= 8


@pytest.mark.parametrize("variant", ["plain", "chunked", "reversed"])
def test_llava_parity(tiny_llava_dir, llava_oracle, variant, spec):
    kw = {"max_num_batched_tokens": 48} if variant == "chunked" else {}
    llm = LLM(config(tiny_llava_dir, **kw, **spec(tiny_llava_dir)))
    batch = llava_batch()
    order = list(reversed(range(len(batch)))) if variant == "reversed" else None
    check(run_batch(llm, batch, order), llava_oracle)
    assert llm.engine.kv.pool.num_used == 0
    spec_used(llm, spec)


def test_llava_parity_with_prefix_cache_hits(tiny_llava_dir, llava_oracle, spec):
    llm = LLM(config(tiny_llava_dir, **spec(tiny_llava_dir)))
    first = run_batch(llm, llava_batch(), tag="a")
    check(first, llava_oracle)
    encoded = llm.engine.runner.num_images_encoded
    second = run_batch(llm, llava_batch(), tag="b")
    check(second, llava_oracle)
    assert all(o.num_cached_tokens > 0 for o in second if len(o.prompt_token_ids) > 32)
    assert sum(o.num_cached_tokens for o in second) > sum(o.num_cached_tokens for o in first)
    # Every image was seen: the second run encodes none (vision cache by image key).
    assert llm.engine.runner.num_images_encoded == encoded
    spec_used(llm, spec)


@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_llava_parity_under_preemption(tiny_llava_dir, llava_oracle, policy, spec):
    # 42 blocks hold the longest request (605 + 11 tokens) but not the batch; small chunks
    # keep several prefills in flight, so decodes run out of blocks and preempt.
    llm = LLM(
        config(
            tiny_llava_dir,
            num_kv_blocks=42,
            max_num_batched_tokens=96,
            preemption=policy,
            **spec(tiny_llava_dir),
        )
    )
    check(run_batch(llm, llava_batch()), llava_oracle)
    spec_used(llm, spec)
    assert llm.engine.scheduler.num_preemptions >= 3
    assert (llm.engine.scheduler.num_swapped_out > 0) == (policy == "swap")
    assert llm.engine.kv.pool.num_used == 0


@pytest.mark.parametrize("variant", ["plain", "chunked-preempt"])
def test_text_parity(tiny_text_dir, text_oracle, variant, spec):
    kw = {}
    if variant == "chunked-preempt":
        kw = {"max_num_batched_tokens": 40, "num_kv_blocks": 42}
    llm = LLM(config(tiny_text_dir, **kw, **spec(tiny_text_dir)))
    check(run_batch(llm, text_batch()), text_oracle)
    if variant == "chunked-preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    second = run_batch(llm, text_batch(), tag="again")
    check(second, text_oracle)
    assert any(o.num_cached_tokens > 0 for o in second)
    spec_used(llm, spec)


@pytest.mark.parametrize("variant", ["plain", "chunked-preempt"])
def test_text_parity_with_in_place_cpu_decode(tiny_text_dir, text_oracle, variant):
    """``cpu_decode_attention="flex"``: decode steps read the paged cache in place (CPU)."""
    kw = {"max_num_batched_tokens": 40, "num_kv_blocks": 42} if variant != "plain" else {}
    cpu = {"device": "cpu", "attention_backend": "torch"}  # the path's only home
    llm = LLM(config(tiny_text_dir, cpu_decode_attention="flex", **cpu, **kw))
    backend = llm.engine.core.runner.backend
    check(run_batch(llm, text_batch()), text_oracle)
    assert backend.cpu_decode == "flex"  # no fallback to the gather
    assert backend._mask_meta is not None  # decode steps took the path
