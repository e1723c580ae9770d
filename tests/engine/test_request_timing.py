"""The timestamps a request's outputs carry: queue time (first admission) and TTFT."""

import time

import pytest

from loraplex.engine.sampling.params import SamplingParams

from .conftest import user


@pytest.fixture(scope="module")
def llm(tiny_llava_dir, make_llm):
    return make_llm(model=tiny_llava_dir, num_kv_blocks=128)


def test_queue_time_is_the_wait_before_the_first_admission(llm):
    engine = llm.engine
    waited = 0.05
    request = llm.make_request(
        user("hello there"), SamplingParams(temperature=0, max_tokens=4), request_id="q1"
    )
    engine.add_request(request)
    time.sleep(waited)  # no step runs: the request waits in the queue
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    first, last = outputs[0], outputs[-1]
    assert first.queue_time is not None
    # The wait counts (a lower bound by construction) and it ends before the first token.
    assert waited <= first.queue_time <= first.ttft
    # Fixed at the first admission: every later output repeats it.
    assert {o.queue_time for o in outputs} == {first.queue_time}
    assert last.finished and last.outputs[0].num_tokens == 4


def test_a_request_never_admitted_has_no_queue_time(llm):
    engine = llm.engine
    request = llm.make_request(
        user("never run"), SamplingParams(temperature=0, max_tokens=4), request_id="q2"
    )
    engine.add_request(request)
    out = engine.abort_request("q2")
    assert out.finished and out.queue_time is None and out.ttft is None
