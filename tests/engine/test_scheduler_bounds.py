"""The scheduler never livelocks on a sequence the pool cannot hold (issue 13), and shares steps.

Driven without a model, through the one-way step contract: ``schedule()``, then a fake runner's
``ModelRunnerOutput`` (token 7 for every sequence that samples), then ``update_from_output``.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.scheduling.budget import PrefillBudget
from loraplex.engine.scheduling.output import ModelRunnerOutput
from loraplex.engine.scheduling.scheduler import Scheduler
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.hashing.request_hasher import RequestBlockHasher

BLOCK = 4


def make_seq(seq_id: str, prompt_len: int, max_tokens: int = 1000, first: int = 1) -> Sequence:
    request = EngineRequest(
        seq_id, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens)
    )
    hasher = RequestBlockHasher(BLOCK)
    hasher.extend(request.prompt_token_ids)
    return Sequence(seq_id, request, 0, list(request.prompt_token_ids), hasher)


def fake_runner(out) -> ModelRunnerOutput:
    """Token 7 for every sequence that samples (one per fork)."""
    return ModelRunnerOutput(
        sampled={i.seq_id: [7] * max(1, len(i.fork_ids)) for i in out.scheduled if i.sample}
    )


def run_step(scheduler: Scheduler):
    out = scheduler.schedule()
    scheduler.update_from_output(out, fake_runner(out))
    return out


def ids(items) -> dict[str, int]:
    return {i.seq_id: i.num_new_tokens for i in items}


def make_scheduler(kv, *, max_num_batched_tokens=64, max_num_seqs=8, **kw) -> Scheduler:
    budget = PrefillBudget(
        max_num_batched_tokens,
        long_prefill_token_threshold=kw.pop("long_prefill_token_threshold", 0),
        tenant_prefill_tokens=kw.pop("tenant_prefill_tokens", 0),
        attention_cost=kw.pop("attention_cost", 0.0),
    )
    return Scheduler(
        kv, max_num_seqs=max_num_seqs, budget=budget, max_loras=1, max_model_len=10_000, **kw
    )


def scheduler(num_blocks: int, **kw) -> Scheduler:
    return make_scheduler(KVCacheManager(num_blocks, BLOCK), **kw)


@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_a_sequence_that_outgrows_the_pool_finishes_with_length(policy):
    from loraplex.engine.kv_cache.swap import CpuBlockPool

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
    assert capped == ["a"] and seq.finish_reason == "length"
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
    assert out.capped == ["big"] and seq.finish_reason == "length"
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


# ----------------------------------------------------------------------- fairness (VTC)
def tenant_seq(seq_id: str, tenant: str, prompt_len: int = 6, first: int = 1) -> Sequence:
    seq = make_seq(seq_id, prompt_len, first=first)
    seq.request.tenant = tenant
    return seq


def running_ids(s: Scheduler) -> list[str]:
    return [seq.seq_id for seq in s.running]


def test_one_tenant_is_served_first_come_first_served():
    s = scheduler(64)
    s.max_num_seqs = 2
    seqs = [tenant_seq(f"a{i}", "a") for i in range(5)]
    for seq in seqs:
        s.add(seq)
    order = []
    for _ in range(60):
        run_step(s)
        for seq in list(s.running):
            if seq.num_tokens >= 9:
                s.finish(seq, "length")
                order.append(seq.seq_id)
        if not s.waiting and not s.running:
            break
    assert order == [f"a{i}" for i in range(5)]


def test_a_newcomer_gets_a_slot_while_a_flooding_tenant_holds_them_all():
    s = scheduler(256)
    s.max_num_seqs = 4
    flood = [tenant_seq(f"a{i}", "a") for i in range(40)]
    for seq in flood:
        s.add(seq)
    for _ in range(3):  # a holds every slot, 36 more of its sequences wait
        run_step(s)
    assert len(s.running) == 4 and all(q.request.tenant == "a" for q in s.running)
    newcomer = tenant_seq("b0", "b")
    s.add(newcomer)
    steps = 0
    while newcomer not in s.running:
        out = run_step(s)
        steps += 1
        assert steps <= 3
    # One of a's sequences was preempted (recompute) to make room; b then got the slot.
    assert s.num_preemptions == 1 and out.scheduled and newcomer.num_computed_tokens > 0
    assert sum(q.request.tenant == "a" for q in s.running) == 3


def test_no_fairness_preemption_within_a_tenant_or_under_the_share():
    s = scheduler(256)
    s.max_num_seqs = 4
    for i in range(8):
        s.add(tenant_seq(f"a{i}", "a"))
    for _ in range(5):
        run_step(s)
    assert s.num_preemptions == 0  # only a has work: it may use every slot
    s2 = scheduler(256)
    s2.max_num_seqs = 4
    for i in range(2):
        s2.add(tenant_seq(f"a{i}", "a"))
        s2.add(tenant_seq(f"b{i}", "b"))
    run_step(s2)
    s2.add(tenant_seq("a2", "a"))
    for _ in range(4):
        run_step(s2)
    # a and b each hold their share (2 of 4); a's third waits for one of them, nobody is
    # preempted for it.
    assert s2.num_preemptions == 0 and len(s2.running) == 4
    # A third tenant arrives: shares would be 4/3, rounded up to 2: a and b keep theirs.
    s2.add(tenant_seq("c0", "c"))
    for _ in range(3):
        run_step(s2)
    assert s2.num_preemptions == 0 and "c0" not in running_ids(s2)
    s3 = scheduler(256)
    s3.max_num_seqs = 4
    for i in range(3):
        s3.add(tenant_seq(f"a{i}", "a"))
    s3.add(tenant_seq("b0", "b"))
    run_step(s3)
    assert running_ids(s3) == ["a0", "b0", "a1", "a2"]  # ties go to the tenant running fewer
    s3.add(tenant_seq("c0", "c"))  # a holds 3 slots, over its share of 2: one goes to c
    for _ in range(3):
        run_step(s3)
    assert s3.num_preemptions == 1 and running_ids(s3) == ["a0", "b0", "a1", "c0"]


def test_vtc_admits_the_least_served_tenant_next_and_idle_time_banks_no_credit():
    s = scheduler(256)
    s.max_num_seqs = 1
    for i in range(3):
        s.add(tenant_seq(f"a{i}", "a", prompt_len=10))
    s.add(tenant_seq("b0", "b", prompt_len=2))
    run_step(s)  # a0 (oldest head of the tied tenants) runs first
    assert running_ids(s) == ["a0"]
    s.finish(s.running[0], "length")
    run_step(s)  # a was charged 10 prompt tokens + 1: b, at 0, goes next
    assert running_ids(s) == ["b0"]
    s.finish(s.running[0], "length")
    run_step(s)
    assert running_ids(s) == ["a1"]
    # c was never served, but arrives while a is active: lifted to a's counter, no head start.
    s.add(tenant_seq("c0", "c"))
    assert s.waiting.counter("c") >= s.waiting.counter("a") - 11
    assert s.waiting.counter("c") > 0


def test_a_long_prefill_advances_by_the_threshold_while_others_decode():
    s = make_scheduler(KVCacheManager(256, BLOCK), long_prefill_token_threshold=16)
    alone = make_seq("alone", 100)
    s.add(alone)
    assert [i.num_new_tokens for i in run_step(s).scheduled] == [64]  # nobody decodes: all
    s.finish(alone, "abort")
    assert s.kv.reset_prefix_cache()  # "long" below has the same tokens: no hits
    short = make_seq("short", 5)
    s.add(short)
    run_step(s)  # short's prompt computed: it decodes from now on
    long = make_seq("long", 100)
    s.add(long)
    chunks = []
    while long.num_computed_tokens < 100:
        out = run_step(s)
        chunks.append(ids(out.scheduled))
    assert all(c["short"] == 1 for c in chunks)
    # 4 tokens are a prefix hit on "short"'s first block; the other 96 go 16 at a time.
    assert [c["long"] for c in chunks] == [16] * 6


def cost_scheduler(**kw) -> Scheduler:
    return make_scheduler(KVCacheManager(2048, BLOCK), max_num_batched_tokens=256, **kw)


def test_prefill_work_is_shared_max_min_between_tenants():
    s = cost_scheduler(tenant_prefill_tokens=64)
    s.add(tenant_seq("big", "a", prompt_len=400))
    s.add(tenant_seq("small", "b", prompt_len=5, first=1000))
    out = run_step(s)
    # b wants 5 (all of it), a gets the other 59 of the 64 the two tenants share.
    assert ids(out.scheduled) == {"big": 59, "small": 5}
    alone = cost_scheduler(tenant_prefill_tokens=64)
    alone.add(tenant_seq("big", "a", prompt_len=400))
    assert [i.num_new_tokens for i in run_step(alone).scheduled] == [256]  # one tenant: all


def test_while_shared_a_tenant_prefills_one_sequence_per_step():
    s = cost_scheduler(tenant_prefill_tokens=128)
    for i in range(3):
        s.add(tenant_seq(f"a{i}", "a", prompt_len=200, first=1000 * i))
    s.add(tenant_seq("b0", "b", prompt_len=200, first=5000))
    out = run_step(s)
    assert sorted(ids(out.scheduled)) == ["a0", "b0"]
    assert sum(i.num_new_tokens for i in out.scheduled) == 128


@given(
    start=st.integers(0, 100_000),
    most=st.integers(1, 8192),
    allowance=st.floats(0.0, 100_000.0),
    cost=st.sampled_from([0.0, 1 / 350, 1 / 30_000]),
)
def test_tokens_within_is_the_largest_chunk_whose_work_fits(start, most, allowance, cost):
    s = cost_scheduler(attention_cost=cost)
    n = s.budget.tokens_within(start, most, allowance)
    assert 0 <= n <= most
    if n > 1 or (n == 1 and s.budget.cost(start, 1) <= allowance):
        assert s.budget.cost(start, n) <= allowance * (1 + 1e-9)
    if n < most and allowance > 0:
        assert s.budget.cost(start, n + 1) > allowance * (1 - 1e-9)


def test_a_long_context_token_costs_more():
    s = cost_scheduler(attention_cost=1 / 350, tenant_prefill_tokens=64)
    s.add(tenant_seq("decoder", "b", prompt_len=3))
    run_step(s)  # b decodes from now on
    deep = tenant_seq("deep", "a", prompt_len=4000)
    deep.num_computed_tokens = 0
    s.add(deep)
    chunks = []
    for _ in range(1000):
        out = run_step(s)
        chunks.append(next((i for i in out.scheduled if i.seq_id == "deep"), None))
        assert chunks[-1] is not None
        if deep.num_computed_tokens > 3500:
            break
    first, last = chunks[0], chunks[-1]
    # 64 token-equivalents: 63 tokens at the start of the context, 5 near position 3,500.
    assert first.num_new_tokens >= 55 and last.num_new_tokens <= 6


def test_eos_ids_come_from_generation_config_too(tiny_text_dir, tmp_path):
    """A checkpoint listing extra stop ids in generation_config.json stops on them."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_text_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 77]}))
    llm = LLM(EngineConfig(model=str(model), num_kv_blocks=32))
    assert 77 in llm.engine.core.eos_token_ids
    assert 77 in llm.engine.scheduler.eos_token_ids
