"""The scheduler never livelocks on a sequence the pool cannot hold (issue 13).

Driven without a model: each step, every scheduled sequence that samples gets one more token,
as the engine does after the forward pass.
"""

import pytest

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.llm import LLM
from engine.request import EngineRequest, Sequence, SequenceStatus
from engine.sampling.params import SamplingParams
from engine.scheduler import Scheduler
from hashing.request_hasher import RequestBlockHasher

BLOCK = 4


def make_seq(seq_id: str, prompt_len: int, max_tokens: int = 1000) -> Sequence:
    request = EngineRequest(
        seq_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens)
    )
    hasher = RequestBlockHasher(BLOCK)
    hasher.extend(request.prompt_token_ids)
    return Sequence(seq_id, request, 0, list(request.prompt_token_ids), hasher)


def run_step(scheduler: Scheduler):
    out = scheduler.schedule()
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed_tokens = item.start + item.num_new_tokens
        if item.sample:
            seq.token_ids.append(7)
            seq.hasher.extend([7])
    return out


def scheduler(num_blocks: int, **kw) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_loras=1, **kw)


@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_a_sequence_that_outgrows_the_pool_finishes_with_length(policy):
    from engine.swap import CpuBlockPool

    s = scheduler(4, preemption=policy, cpu_pool=CpuBlockPool(8) if policy == "swap" else None)
    seq = make_seq("a", 6)
    s.add(seq)
    capped = []
    for _ in range(40):
        out = run_step(s)
        capped.extend(out.capped)
        if seq.is_finished:
            break
    # 4 blocks of 4 hold 16 tokens: the 17th cannot be written anywhere.
    assert capped == [seq] and seq.finish_reason == "length"
    assert seq.num_tokens == 17 and s.num_preemptions == 0
    assert s.kv.num_free_blocks == 4 and not s.running and not s.waiting


def test_the_oldest_keeps_running_and_the_newest_waits_then_runs():
    s = scheduler(6)
    a, b = make_seq("a", 8), make_seq("b", 8)
    s.add(a)
    s.add(b)
    steps = 0
    while not (a.is_finished and b.is_finished) and steps < 200:
        out = run_step(s)
        steps += 1
        for seq in (a, b):  # as the engine does at max_tokens
            if (
                not seq.is_finished
                and seq.num_tokens >= 20
                and seq.status is SequenceStatus.RUNNING
            ):
                s.finish(seq, "length")
        assert not out.is_empty() or a.is_finished and b.is_finished
    # Together they need 10 blocks of the 6: b is preempted, a finishes, then b runs alone.
    assert a.finish_reason == b.finish_reason == "length"
    assert s.num_preemptions >= 1 and steps < 200


def test_a_waiting_head_that_cannot_fit_an_idle_pool_is_finished_not_spun_on():
    s = scheduler(4)
    seq = make_seq("big", 6)
    seq.token_ids.extend([7] * 14)  # a preempted sequence that had grown to 20 tokens
    seq.hasher.extend([7] * 14)
    s.add(seq)
    out = run_step(s)
    assert out.capped == [seq] and seq.finish_reason == "length"
    assert not s.waiting and s.kv.num_free_blocks == 4


def test_the_models_length_is_clamped_to_the_pool(tiny_text_dir):
    llm = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=8, block_size=16))
    engine = llm.engine
    assert engine.max_model_len == 8 * 16 < engine.model.max_position_embeddings
    # A prompt that fills the pool but for a few tokens ends with "length", never stalls.
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    out = llm.generate([EngineRequest("r", list(range(3, 3 + 120)), params)])
    assert out[0].outputs[0].finish_reason == "length"
    assert len(out[0].prompt_token_ids) + len(out[0].outputs[0].token_ids) == 128


def test_an_explicit_length_the_pool_cannot_hold_is_refused(tiny_text_dir):
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=8, block_size=16, max_model_len=200))
