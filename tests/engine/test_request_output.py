"""RequestOutput.add: DELTA outputs added up equal the FINAL_ONLY output of the same run."""

import dataclasses

import pytest

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest, RequestOutputKind
from loraplex.engine.sampling.params import SamplingParams


def test_delta_outputs_added_up_equal_the_final_output(tiny_text_dir):
    llm = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=64))
    params = SamplingParams(n=2, max_tokens=6, seed=3, logprobs=1, stop=["e"])
    request = EngineRequest("r", list(range(3, 30)), params)
    (final,) = llm.generate([request])  # FINAL_ONLY
    engine = llm.engine
    engine.add_request(dataclasses.replace(request, output_kind=RequestOutputKind.DELTA))
    total = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if total is None:
                total = out
            else:
                total.add(out)
    assert total.finished
    got = [(c.index, c.text, c.token_ids, c.finish_reason, c.num_tokens) for c in total.outputs]
    want = [(c.index, c.text, c.token_ids, c.finish_reason, c.num_tokens) for c in final.outputs]
    assert got == want
    for mine, theirs in zip(total.outputs, final.outputs, strict=True):
        # The second run hits the first one's prefix cache: logprobs agree to float noise.
        assert [lp for lp, _ in mine.logprobs] == pytest.approx([lp for lp, _ in theirs.logprobs])
        assert [[t for t, _ in top] for _, top in mine.logprobs] == [
            [t for t, _ in top] for _, top in theirs.logprobs
        ]
