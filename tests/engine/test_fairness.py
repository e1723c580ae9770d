"""Fair sharing between tenants on the real engine: a newcomer starts within a few steps while
another tenant holds every slot, and the preemptions that make room change no token."""

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompt(i):
    return [3 + (11 * i + j) % 150 for j in range(30 + 3 * i)]


def test_a_newcomer_starts_within_a_few_steps_and_every_token_is_unchanged(tiny_text_dir):
    reference = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=256))
    expected = {
        o.request_id: o.outputs[0].token_ids
        for o in reference.generate(
            [EngineRequest(f"a{i}", prompt(i), GREEDY) for i in range(6)]
            + [EngineRequest("b0", prompt(20), GREEDY)]
        )
    }
    llm = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=256, max_num_seqs=4))
    engine = llm.engine
    for i in range(6):
        engine.add_request(EngineRequest(f"a{i}", prompt(i), GREEDY, tenant="a"))
    got: dict[str, list[int]] = {}
    first_token_step = None
    for step in range(1000):
        if step == 3:  # tenant a holds all 4 slots, 2 more of its requests wait
            assert len(engine.scheduler.running) == 4
            engine.add_request(EngineRequest("b0", prompt(20), GREEDY, tenant="b"))
        for out in engine.step():
            if out.request_id == "b0" and out.outputs[0].token_ids and first_token_step is None:
                first_token_step = step
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)  # DELTA
        if not engine.has_unfinished_requests():
            break
    assert got == expected
    assert first_token_step is not None and first_token_step - 3 <= 3
    assert engine.scheduler.num_preemptions >= 1
    assert engine.kv.pool.num_used == 0
