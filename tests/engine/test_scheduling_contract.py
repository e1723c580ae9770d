"""What the scheduling package hands on: the KV manager's trims to the runner, and an
adapter's load error in the output's ``error`` field (not its ``stop_reason``)."""

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.scheduling.budget import PrefillBudget
from loraplex.engine.scheduling.output import ModelRunnerOutput
from loraplex.engine.scheduling.scheduler import Scheduler
from loraplex.engine.sequence import Sequence
from loraplex.hashing.request_hasher import RequestBlockHasher

BLOCK = 4


def make_seq(rid: str, prompt_len: int, **params) -> Sequence:
    request = EngineRequest(rid, list(range(10, 10 + prompt_len)), SamplingParams(**params))
    hasher = RequestBlockHasher(BLOCK)
    hasher.extend(request.prompt_token_ids)
    return Sequence(rid, request, 0, list(request.prompt_token_ids), hasher)


def test_the_trim_after_verification_is_the_managers_and_travels_in_the_steps_output():
    kv = KVCacheManager(64, BLOCK)
    s = Scheduler(
        kv,
        max_num_seqs=4,
        budget=PrefillBudget(64),
        max_loras=1,
        max_model_len=1000,
        num_speculative_tokens=4,
    )
    seq = make_seq("r", 6, max_tokens=50, ignore_eos=True)
    s.add(seq)
    table: list[int] = []  # the runner's view, built only from what the steps say
    trims = []
    for _ in range(8):
        sched = s.schedule()
        for new in sched.new_seqs:
            table = list(new.block_ids)
        for item in sched.scheduled:
            table.extend(item.new_block_ids)
        (item,) = sched.scheduled
        # Every proposal rejected: the step keeps one token; propose 4 for the next step.
        result = ModelRunnerOutput(sampled={"r": [5]}, spec_token_ids={"r": [1, 2, 3, 4]})
        s.update_from_output(sched, result)
        if sched.kv_trims:  # lookahead slots past a block boundary were given back
            assert item.spec_token_ids
            assert sched.kv_trims == {"r": kv.num_blocks_of("r")}
            trims.append(sched.kv_trims["r"])
        del table[sched.kv_trims.get("r", len(table)) :]
        assert table == kv.get_block_ids("r")
        assert len(table) == -(-seq.num_computed_tokens // BLOCK)
    assert trims  # some step speculated and gave blocks back


def test_an_adapter_that_cannot_load_aborts_with_its_message_in_error(tiny_text_dir):
    llm = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=64))
    core = llm.engine.core
    message = "adapter " + "e" * 64 + " cannot be loaded: no such files"

    def acquire(digest):
        raise ValueError(message)  # what the LoRA manager raises (AdapterError)

    core.lora_manager.holds = lambda digest: True
    core.lora_manager.acquire = acquire
    request = EngineRequest("gone", [3, 4, 5], SamplingParams(max_tokens=4), lora_digest="e" * 64)
    core.add_request(request)
    (core_out,) = core.step()
    assert (core_out.finish_reason, core_out.error, core_out.stop_reason) == (
        "abort",
        message,
        None,
    )
    assert core_out.request_finished
    # The client side: an abort (503 at the gateway), its reason on the output, no fault.
    engine = llm.engine
    engine.output_processor.add_request(request)
    (out,) = engine.output_processor.process([core_out]).request_outputs
    assert out.finished and out.error is None
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("abort", message)
    assert core.kv.pool.num_used == 0 and not core.scheduler.requests


def test_a_step_with_nothing_to_run_still_tells_the_runner_what_finished(tiny_text_dir):
    # An abort while nothing else runs: the next step schedules nothing, but the runner must
    # still forget the aborted sequence (its table, generator and tokens), or it leaks them.
    llm = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=64))
    core = llm.engine.core
    request = EngineRequest("r", [3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True, seed=7))
    core.add_request(request)
    core.step()
    core.step()
    assert "r" in core.runner.seqs and "r" in core.runner.generators
    core.abort_request("r")
    assert core.step() == []
    assert not core.runner.seqs and not core.runner.generators
