"""Prompt logprobs (vLLM's ``prompt_logprobs``) against transformers' own logits, float32.

The engine computes them in the prefill it runs anyway, chunk by chunk; a request that asks
for them takes no prefix-cache hits (a cached block holds KV, not logits) but still leaves its
blocks for others. Checked: a plain prefill, a chunked one (a 16-token budget), a request
whose prefix is cached, a batch mixed with requests that do not ask (their tokens and
logprobs unchanged), ``n > 1``, and ``max_tokens=0`` (the prefill alone).
"""

import pytest
import torch

from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

TOL = 1e-4


def prompt(length, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def oracle(hf, ids):
    """transformers' ``log_softmax(logits)``: row ``p`` is the distribution of token ``p+1``."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(out, hf, k):
    ids = out.prompt_token_ids
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    logp = oracle(hf, ids)
    for p in range(1, len(ids)):
        lp, rank, top = got[p]
        want = logp[p - 1]
        assert abs(lp - want[ids[p]].item()) < TOL, f"position {p}"
        assert rank == int((want > want[ids[p]]).sum()) + 1
        assert len(top) == k
        top_v = want.topk(k).values.tolist()
        for (tid, tv), wv in zip(top, top_v, strict=True):
            assert abs(tv - wv) < TOL and abs(want[tid].item() - tv) < TOL


def run(llm, requests):
    return llm.generate(requests)


@pytest.fixture(scope="module")
def hf(hf_text):
    return hf_text[0]  # (model, tokenizer) in tests/engine


@pytest.fixture(scope="module")
def vocab(hf):
    return hf.config.vocab_size


def req(rid, ids, **kw):
    kw.setdefault("temperature", 0.0)
    return EngineRequest(rid, ids, SamplingParams(**kw))


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_equal_transformers(make_llm, tiny_text_dir, hf, vocab, chunk):
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = make_llm(model=tiny_text_dir, **kw)
    ids = prompt(75, seed=1, vocab=vocab)
    (out,) = run(llm, [req(f"plain-{chunk}", ids, max_tokens=3, prompt_logprobs=3)])
    check(out, hf, 3)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    assert llm.engine.kv.pool.num_used == 0


def test_a_cached_prefix_is_computed_again_and_others_still_hit(make_llm, tiny_text_dir, hf, vocab):
    llm = make_llm(model=tiny_text_dir, max_num_batched_tokens=16)
    shared = prompt(64, seed=2, vocab=vocab)
    (warm,) = run(llm, [req("warm", shared + [5, 6, 7], max_tokens=1)])
    (scored,) = run(llm, [req("scored", shared + [8, 9], max_tokens=1, prompt_logprobs=0)])
    assert scored.num_cached_tokens == 0  # every position computed, though 64 were cached
    check(scored, hf, 0)
    # Its own blocks went to the prefix cache: a plain request after it hits them.
    (after,) = run(llm, [req("after", shared + [8, 9, 10], max_tokens=1)])
    assert after.num_cached_tokens >= 64
    assert warm.num_cached_tokens == 0 or warm.num_cached_tokens % 16 == 0


def test_mixed_batch_n_and_prefill_only(make_llm, tiny_text_dir, hf, vocab):
    llm = make_llm(model=tiny_text_dir, max_num_batched_tokens=16)
    plain = [prompt(40 + 7 * i, seed=10 + i, vocab=vocab) for i in range(3)]
    alone = run(
        llm, [req(f"alone-{i}", ids, max_tokens=5, logprobs=2) for i, ids in enumerate(plain)]
    )
    scored = prompt(50, seed=20, vocab=vocab)
    batch = [req(f"mixed-{i}", ids, max_tokens=5, logprobs=2) for i, ids in enumerate(plain)]
    batch.insert(1, req("scored-n", scored, max_tokens=2, n=2, seed=3, temperature=1.0,
                        prompt_logprobs=2))  # fmt: skip
    batch.append(req("prefill-only", scored[:33], max_tokens=0, n=3, prompt_logprobs=1))
    outs = {o.request_id: o for o in run(llm, batch)}
    for i, a in enumerate(alone):  # the requests that did not ask are unchanged
        m = outs[f"mixed-{i}"]
        assert m.prompt_logprobs is None
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
        for (x, xt), (y, yt) in zip(m.outputs[0].logprobs, a.outputs[0].logprobs, strict=True):
            assert abs(x - y) < TOL and [t for t, _ in xt] == [t for t, _ in yt]
    n = outs["scored-n"]
    check(n, hf, 2)
    assert sorted(c.index for c in n.outputs) == [0, 1]
    only = outs["prefill-only"]
    check(only, hf, 1)
    assert [(c.index, c.token_ids, c.finish_reason) for c in only.outputs] == [
        (i, [], "length") for i in range(3)
    ]
    assert llm.engine.kv.pool.num_used == 0


def test_the_lm_head_sees_only_what_is_asked_and_a_chunk_at_most(make_llm, tiny_text_dir, vocab):
    """A normal prefill computes one logits row; a scored one a chunk's rows at most."""
    llm = make_llm(model=tiny_text_dir, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    rows: list[int] = []
    original = model.compute_logits

    def spy(hidden):
        rows.append(hidden.shape[0])
        return original(hidden)

    model.compute_logits = spy
    try:
        run(llm, [req("normal", prompt(300, seed=30, vocab=vocab), max_tokens=1)])
        assert rows == [1] * len(rows)  # each chunk: nothing, the last one: its last position
        rows.clear()
        (out,) = run(llm, [req("long", prompt(300, seed=31, vocab=vocab), max_tokens=1,
                                prompt_logprobs=20)])  # fmt: skip
    finally:
        del model.compute_logits
    assert len(out.prompt_logprobs) == 300
    assert max(rows) <= 64 and sum(rows) == 299 + 1  # 299 prompt positions, 1 sampled row


def test_prompt_logprobs_rows_are_computed_a_block_at_a_time():
    from loraplex.engine.sampling.logprobs import prompt_logprobs

    hidden = torch.randn(10, 8)
    head = torch.nn.Linear(8, 32)
    seen = []

    def logits(h):
        seen.append(h.shape[0])
        return head(h)

    got = prompt_logprobs(hidden, list(range(10)), 4, logits, rows_per_block=4)
    assert seen == [4, 4, 2] and len(got) == 10
    want = torch.log_softmax(head(hidden), -1)
    for i, (lp, rank, top) in enumerate(got):
        assert abs(lp - want[i, i].item()) < 1e-6 and len(top) == 4
        assert rank == int((want[i] > want[i, i]).sum()) + 1


def test_the_core_process_wire_carries_them():
    from loraplex.engine.core.wire import AddRequest, Outputs, client_decoder, core_decoder, encoder
    from loraplex.engine.scheduling.output import EngineCoreOutput

    sent = AddRequest(req("w", [1, 2, 3], max_tokens=0, prompt_logprobs=5))
    got = core_decoder().decode(encoder().encode(sent))
    assert got.request.sampling.prompt_logprobs == 5 and got.request.sampling.max_tokens == 0
    entries = [(-1.5, 2, [(7, -0.5), (3, -1.5)]), (float("-inf"), 1024, [(7, -0.1), (9, -2.0)])]
    out = EngineCoreOutput("w", 0, [], finish_reason="length", prompt_logprobs=entries)
    back = client_decoder().decode(encoder().encode(Outputs([out], {})))
    assert back.outputs[0].prompt_logprobs == entries
    bad = encoder().encode(AddRequest(req("w", [1], prompt_logprobs=3)))
    bad = bad.replace(b"prompt_logprobs\x03", b"prompt_logprobs\x7f")  # 127: out of range
    with pytest.raises(Exception, match="prompt_logprobs"):
        core_decoder().decode(bad)
