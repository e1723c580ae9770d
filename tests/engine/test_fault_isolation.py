"""A fault in one request's part of a step fails that request alone (issue 13).

Faults are injected where a request's data meets batched code: the forward pass, the sampler,
the detokenizer. Every other request of the batch must give exactly the tokens it gives when
the faulty one is not there (greedy), the faulty one ends with ``finish_reason="error"``, no
block leaks, and no block the failed step was filling stays in the prefix cache.
"""

import asyncio

import pytest

from loraplex.engine.client.front import AsyncLLM
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.core.engine_core import MAX_FAILING_STEPS, EngineFaultError
from loraplex.engine.errors import EngineDeadError
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def llm(tiny_text_dir):
    """An engine of its own per test: these tests break it on purpose (not ``make_llm``'s)."""
    return LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=128, max_num_batched_tokens=512))


def prompts(n, length=40):
    return [[3 + (7 * i + j) % 200 for j in range(length + i)] for i in range(n)]


def requests(n, params=GREEDY, prefix="r"):
    return [EngineRequest(f"{prefix}{i}", p, params) for i, p in enumerate(prompts(n))]


def tokens(outputs):
    return {o.request_id: [c.token_ids for c in o.outputs] for o in outputs}


def clean_run(llm, n=6):
    return tokens(llm.generate(requests(n)))


def poison_forward(engine, poisoned):
    """Make the forward pass raise whenever a poisoned request's sequence is in the batch."""
    forward = engine.runner.forward

    def faulty(items):
        if any(item.seq_id.split("#")[0] in poisoned for item in items):
            raise RuntimeError("injected forward fault")
        return forward(items)

    engine.runner.forward = faulty


def test_a_forward_fault_fails_only_its_request(llm):
    expected = clean_run(llm)
    poison_forward(llm.engine, {"bad"})
    bad = EngineRequest("bad", list(range(3, 70)), GREEDY)
    outs = llm.generate([*requests(6)[:3], bad, *requests(6)[3:]])
    by_id = {o.request_id: o for o in outs}
    assert by_id["bad"].error is not None and by_id["bad"].finished
    assert [c.finish_reason for c in by_id["bad"].outputs] == ["error"]
    del by_id["bad"]
    assert tokens(by_id.values()) == expected
    assert llm.engine.kv.pool.num_used == 0


def test_blocks_a_failed_step_was_filling_leave_the_prefix_cache(llm):
    poison_forward(llm.engine, {"bad"})
    prompt = list(range(3, 3 + 16 * 4 + 5))  # 4 full blocks, computed in the failing step
    llm.generate([EngineRequest("bad", prompt, GREEDY)])
    cached = llm.engine.kv.get_computed_blocks(_hashes(llm, prompt), len(prompt)).num_cached_tokens
    assert cached == 0
    # The same prompt under another id runs cleanly and matches a fresh engine's tokens.
    again = llm.generate([EngineRequest("good", prompt, GREEDY)])[0]
    assert again.num_cached_tokens == 0 and again.error is None


def _hashes(llm, prompt):
    from loraplex.hashing.request_hasher import RequestBlockHasher

    hasher = RequestBlockHasher(llm.engine.kv.block_size)
    hasher.extend(prompt)
    return hasher.block_hashes


def test_a_sequence_that_hit_a_failing_requests_fresh_blocks_is_recomputed(llm):
    prompt = list(range(3, 3 + 16 * 3 + 2))
    expected = tokens(llm.generate([EngineRequest("twin", prompt, GREEDY)]))["twin"]
    llm.engine.kv.reset_prefix_cache()
    poison_forward(llm.engine, {"bad"})
    # Same prompt, same step: "twin" hits the blocks "bad" registers when it is allocated.
    outs = llm.generate(
        [EngineRequest("bad", prompt, GREEDY), EngineRequest("twin", prompt, GREEDY)]
    )
    by_id = {o.request_id: o for o in outs}
    assert by_id["bad"].error is not None
    assert [c.token_ids for c in by_id["twin"].outputs] == expected
    assert llm.engine.scheduler.num_preemptions >= 1  # twin was requeued, not sampled
    assert llm.engine.kv.pool.num_used == 0


def test_a_sampler_fault_fails_only_its_request(llm):
    expected = clean_run(llm)
    sampler = llm.engine.runner.sampler

    class Faulty:
        def __call__(self, logits, params, generators, **kw):
            if any(p.seed == 666 for p in params):
                raise OverflowError("injected sampler fault")
            return sampler(logits, params, generators, **kw)

    llm.engine.runner.sampler = Faulty()
    bad = EngineRequest("bad", list(range(3, 50)), SamplingParams(seed=666, max_tokens=5))
    outs = llm.generate([bad, *requests(6)])
    by_id = {o.request_id: o for o in outs}
    assert by_id.pop("bad").outputs[0].finish_reason == "error"
    assert tokens(by_id.values()) == expected


def test_a_detokenizer_fault_fails_only_its_request(llm):
    expected = clean_run(llm)
    engine = llm.engine
    add = engine.add_request

    def add_poisoned(request):
        add(request)
        if request.request_id == "bad":

            def boom(token, **kw):
                raise UnicodeError("injected detokenizer fault")

            processor = engine.output_processor
            processor._output(processor.requests["bad"], 0).detokenizer.append = boom

    engine.add_request = add_poisoned
    outs = llm.generate([EngineRequest("bad", list(range(3, 30)), GREEDY), *requests(6)])
    by_id = {o.request_id: o for o in outs}
    assert by_id.pop("bad").error is not None
    assert tokens(by_id.values()) == expected
    assert engine.kv.pool.num_used == 0


def test_a_fault_in_one_of_n_forks_ends_the_whole_request_only(llm):
    expected = clean_run(llm, 3)
    poison_forward(llm.engine, {"bad"})
    bad = EngineRequest("bad", list(range(3, 40)), SamplingParams(n=3, max_tokens=4, seed=1))
    outs = llm.generate([*requests(3), bad])
    by_id = {o.request_id: o for o in outs}
    assert [c.finish_reason for c in by_id.pop("bad").outputs] == ["error"]
    assert tokens(by_id.values()) == expected


def test_a_broken_engine_gives_up_after_a_few_steps(llm):
    def broken(items):
        raise RuntimeError("device lost")

    llm.engine.runner.forward = broken
    for r in requests(2):
        llm.engine.add_request(r)
    with pytest.raises(EngineFaultError):
        for _ in range(MAX_FAILING_STEPS + 2):
            llm.engine.step()
            for r in requests(2, prefix=f"more{_}"):
                llm.engine.add_request(r)


def test_async_engine_dies_cleanly_and_says_so(tiny_text_dir):
    llm = AsyncLLM.in_process(EngineConfig(model=tiny_text_dir, num_kv_blocks=64))

    def broken(items):
        raise RuntimeError("device lost")

    llm.core.engine_core.runner.forward = broken

    async def main():
        results = []
        for i in range(MAX_FAILING_STEPS + 1):
            try:
                async for out in llm.generate(EngineRequest(f"x{i}", [5, 6, 7], GREEDY)):
                    results.append(out.error)
            except EngineDeadError:
                results.append("dead")
        return results

    try:
        results = asyncio.run(main())
        assert results[: MAX_FAILING_STEPS - 1] == ["the request failed in the forward pass"] * (
            MAX_FAILING_STEPS - 1
        )
        assert results[-1] == "dead" and not llm.is_running
    finally:
        llm.shutdown()
