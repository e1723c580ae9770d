"""``fan_in``: several prompts' engine streams read as one request's (no engine, no server).

Choices are renumbered ``i * n + j``, counts summed, the merged stream finishes with the last
prompt; one prompt failing (an error output, an abort, an exception) or the reader being
cancelled closes every other prompt's stream (which is what aborts its engine request).
"""

import asyncio

import pytest

from loraplex.engine.request import CompletionOutput, EngineRequest, RequestOutput
from loraplex.engine.sampling.params import SamplingParams
from loraplex.gateway.domains.chat.batch import fan_in, prompt_spans


class FakeEngine:
    """``generate`` per request id: ``plans[id]`` lists what each step brings.

    A step is ``"tok"`` (one token per choice), ``"end"`` (the last token, ``length``),
    ``"error"`` (finished with an error), ``"abort"`` (finished ``abort``), ``"raise"``
    (raises ``ValueError``) or ``"wait"`` (blocks until cancelled). ``closed`` collects the
    ids whose stream was closed before it finished (an engine abort).
    """

    def __init__(self, plans):
        self.plans = plans
        self.closed = []

    async def generate(self, request):
        rid, n = request.request_id, request.sampling.n
        finished = False
        try:
            for k, step in enumerate(self.plans[rid], 1):
                await asyncio.sleep(0)
                if step == "raise":
                    raise ValueError(f"{rid} refused")
                if step == "wait":
                    await asyncio.Event().wait()
                finished = step != "tok"
                finish = {"tok": None, "end": "length", "error": "error", "abort": "abort"}[step]
                yield RequestOutput(
                    request_id=rid,
                    prompt_token_ids=request.prompt_token_ids,
                    outputs=[CompletionOutput(j, "x", [7], finish, num_tokens=k) for j in range(n)],
                    finished=finished,
                    num_cached_tokens=len(request.prompt_token_ids) // 2,
                    error="boom" if step == "error" else None,
                )
        finally:
            if not finished:
                self.closed.append(rid)


def requests(count, n=2):
    return [
        EngineRequest(f"cmpl-1-{i}", [1] * (4 + i), SamplingParams(n=n, max_tokens=8))
        for i in range(count)
    ]


async def collect(engine, reqs):
    return [out async for out in fan_in(engine.generate, reqs, "cmpl-1")]


def test_choices_are_renumbered_and_counts_summed():
    engine = FakeEngine(
        {"cmpl-1-0": ["tok", "end"], "cmpl-1-1": ["end"], "cmpl-1-2": ["tok"] * 3 + ["end"]}
    )
    outs = asyncio.run(collect(engine, requests(3)))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    seen = {c.index for o in outs for c in o.outputs}
    assert seen == set(range(6))
    assert all(o.request_id == "cmpl-1" and len(o.prompt_token_ids) == 4 + 5 + 6 for o in outs)
    assert outs[-1].num_cached_tokens == 2 + 2 + 3
    tokens = {}
    for o in outs:
        for c in o.outputs:
            tokens[c.index] = c.num_tokens
    assert tokens == {0: 2, 1: 2, 2: 1, 3: 1, 4: 4, 5: 4}
    assert engine.closed == []


@pytest.mark.parametrize("failure", ["error", "abort"])
def test_a_prompt_that_fails_ends_the_request_and_closes_the_others(failure):
    engine = FakeEngine(
        {"cmpl-1-0": ["tok", "wait"], "cmpl-1-1": ["tok", failure], "cmpl-1-2": ["wait"]}
    )
    outs = asyncio.run(collect(engine, requests(3)))
    last = outs[-1]
    assert last.finished and {c.index for c in last.outputs} == {2, 3}
    assert (last.error is not None) == (failure == "error")
    assert sorted(engine.closed) == ["cmpl-1-0", "cmpl-1-2"]


def test_an_exception_from_one_prompt_is_raised_after_closing_the_others():
    engine = FakeEngine({"cmpl-1-0": ["tok", "wait"], "cmpl-1-1": ["tok", "raise"]})
    with pytest.raises(ValueError, match="cmpl-1-1 refused"):
        asyncio.run(collect(engine, requests(2)))
    assert sorted(engine.closed) == ["cmpl-1-0", "cmpl-1-1"]


def test_cancelling_the_reader_closes_every_prompt():
    engine = FakeEngine({f"cmpl-1-{i}": ["tok", "wait"] for i in range(3)})

    async def main():
        got = []

        async def read():
            async for out in fan_in(engine.generate, requests(3), "cmpl-1"):
                got.append(out)

        task = asyncio.create_task(read())
        while len(got) < 3:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == []  # no prompt's task outlives the reader
    assert sorted(engine.closed) == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]


class ScoringEngine(FakeEngine):
    """A ``FakeEngine`` whose first output of each prompt carries its prompt logprobs."""

    async def generate(self, request):
        first = True
        async for out in super().generate(request):
            if first:
                ids = request.prompt_token_ids
                out.prompt_logprobs = [None] + [(-1.0 * t, 1, []) for t in ids[1:]]
                first = False
            yield out


def scored_requests(count, n=2):
    return [
        EngineRequest(
            f"cmpl-1-{i}",
            list(range(10 * i, 10 * i + 3 + i)),
            SamplingParams(n=n, max_tokens=8, prompt_logprobs=1),
        )
        for i in range(count)
    ]


def test_prompt_logprobs_are_every_prompts_in_order_once_the_last_came():
    engine = ScoringEngine({"cmpl-1-0": ["tok", "end"], "cmpl-1-1": ["end"], "cmpl-1-2": ["end"]})
    reqs = scored_requests(3)
    outs = asyncio.run(collect(engine, reqs))
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    assert len(carrying) == 1  # once, when the last prompt's came
    merged = carrying[0].prompt_logprobs
    assert len(merged) == len(outs[0].prompt_token_ids) == 3 + 4 + 5
    spans = prompt_spans(reqs)
    assert len(spans) == 6
    for index, span in enumerate(spans):  # choice i * n + j: prompt i's part, None first
        ids = reqs[index // 2].prompt_token_ids
        assert outs[0].prompt_token_ids[span] == ids
        assert merged[span] == [None] + [(-1.0 * t, 1, []) for t in ids[1:]]


def test_no_prompt_logprobs_unless_asked():
    engine = ScoringEngine({"cmpl-1-0": ["end"], "cmpl-1-1": ["end"]})
    outs = asyncio.run(collect(engine, requests(2)))  # prompt logprobs not asked
    assert all(o.prompt_logprobs is None for o in outs) and outs[-1].finished
    assert prompt_spans(requests(2, n=3)) == [slice(0, 4)] * 3 + [slice(4, 9)] * 3
