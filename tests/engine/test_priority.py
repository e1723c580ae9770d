"""Priority classes: batch sequences get only the capacity interactive ones leave.

An interactive request submitted while a batch holds every slot (and more batch lines wait)
starts at the next step, ahead of the waiting batch lines, by preempting the newest batch
sequence; the preemption changes no token. Checked on the real engine and on the queue.

At the scheduler (a fake runner: token 7 for every sampling sequence): an interactive prefill
takes its step without the running batch sequences, which sit out at most
``BATCH_MAX_SIT_OUT`` steps in a row and run as soon as interactive traffic pauses; an
interactive request gets an adapter slot that batch sequences hold; within ``batch_yield_s``
of an interactive arrival a batch step prefills at most ``tenant_prefill_tokens``; and a
schedule with no batch request is the one the scheduler made before the classes.
"""

import hashlib

import torch

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.lora.slots import LoRAManager
from loraplex.engine.request import PRIORITY_BATCH, EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.scheduling.budget import PrefillBudget
from loraplex.engine.scheduling.fair_queue import FairQueue
from loraplex.engine.scheduling.output import ModelRunnerOutput
from loraplex.engine.scheduling.scheduler import BATCH_MAX_SIT_OUT, Scheduler
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.hashing.request_hasher import RequestBlockHasher

from .test_lora_slots import SHAPES
from .test_lora_slots import make as make_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompt(i):
    return [3 + (7 * i + j) % 150 for j in range(20 + 2 * i)]


def test_interactive_request_starts_ahead_of_waiting_batch_lines(tiny_text_dir):
    reference = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=256))
    expected = {
        o.request_id: o.outputs[0].token_ids
        for o in reference.generate(
            [EngineRequest(f"b{i}", prompt(i), GREEDY) for i in range(6)]
            + [EngineRequest("i0", prompt(30), GREEDY)]
        )
    }
    engine = LLM(EngineConfig(model=tiny_text_dir, num_kv_blocks=256, max_num_seqs=2)).engine
    for i in range(6):
        engine.add_request(
            EngineRequest(f"b{i}", prompt(i), GREEDY, tenant="t", priority=PRIORITY_BATCH)
        )
    got: dict[str, list[int]] = {}
    started: dict[str, int] = {}
    for step in range(1000):
        if step == 2:  # the batch holds both slots; four more lines wait
            assert len(engine.scheduler.running) == 2
            assert len(engine.scheduler.waiting) == 4
            # the same tenant, whose counter the batch has raised: the class decides, not VTC
            engine.add_request(EngineRequest("i0", prompt(30), GREEDY, tenant="t"))
        for out in engine.step():
            if out.outputs[0].token_ids:
                started.setdefault(out.request_id, step)
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    assert got == expected
    assert started["i0"] == 2  # its first token in the step it was added
    waiting_batch = [f"b{i}" for i in range(2, 6)]
    assert all(started[b] > started["i0"] for b in waiting_batch)
    assert engine.scheduler.num_preemptions >= 1  # a batch sequence gave its slot
    assert engine.kv.pool.num_used == 0


def _seq(rid, tenant, priority=0):
    request = EngineRequest(rid, [1, 2, 3], GREEDY, tenant=tenant, priority=priority)
    hasher = RequestBlockHasher(4)
    hasher.extend(request.prompt_token_ids)
    return Sequence(rid, request, 0, list(request.prompt_token_ids), hasher)


def test_queue_orders_classes_before_counters():
    q = FairQueue()
    batch = _seq("b", "poor", PRIORITY_BATCH)
    q.append(batch)
    q.charge("rich", 10_000, 10_000)
    interactive = _seq("i", "rich")
    q.append(interactive)
    assert q.peek() is interactive  # the lower class first, however served its tenant was
    assert q.waits_before(PRIORITY_BATCH) and not q.waits_before(0)
    assert q.peek(skip={"rich"}) is batch
    q.remove(interactive)
    assert not q.waits_before(PRIORITY_BATCH)
    assert q.waiting_tenants() == ["poor"] and len(q) == 1


def test_a_batch_head_never_preempts_an_interactive_sequence():
    from loraplex.engine.scheduling.preemption import Preemptor

    q = FairQueue()
    running = [_seq(f"i{k}", "rich") for k in range(4)]
    for s in running:
        q.started(s)
    q.charge("rich", 10_000, 10_000)  # far above the batch tenant: fairness alone would preempt
    head = _seq("b", "poor", PRIORITY_BATCH)
    q.append(head)
    assert Preemptor.fairness_victim(head, running, q, max_num_seqs=4) is None
    mixed = [_seq("b0", "rich", PRIORITY_BATCH), *running[:3]]  # the batch one is the oldest
    interactive_head = _seq("j", "poor")
    assert Preemptor.fairness_victim(interactive_head, mixed, q, max_num_seqs=4) is mixed[0]
    assert Preemptor.room_victim(mixed) is mixed[0]


# --------------------------------------------------------------------- at the scheduler
BLOCK = 4


def scheduler(*, num_blocks=256, max_num_seqs=8, tokens=64, lora_manager=None, **budget):
    """A scheduler over its own KV pool; ``budget`` goes to the ``PrefillBudget``."""
    yield_s = budget.pop("batch_yield_s", 0.0)
    return Scheduler(
        KVCacheManager(num_blocks, BLOCK),
        max_num_seqs=max_num_seqs,
        budget=PrefillBudget(tokens, **budget),
        max_loras=1,
        max_model_len=10_000,
        lora_manager=lora_manager,
        batch_yield_s=yield_s,
    )


def add(s, rid, prompt_len, max_tokens=20, priority=0, tenant=None, lora=None, n=1):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
    ids = [10 + (13 * j + 7 * sum(map(ord, rid))) % 200 for j in range(prompt_len)]
    request = EngineRequest(rid, ids, params, lora_digest=lora, tenant=tenant, priority=priority)
    hasher = RequestBlockHasher(BLOCK, lora_digest=lora)
    hasher.extend(ids)
    seq = Sequence(rid, request, 0, list(ids), hasher)
    s.add(seq)
    return seq


def step(s):
    """One step with token 7 for every sampling sequence: ``{seq_id: tokens computed}``."""
    out = s.schedule()
    sampled = {i.seq_id: [7] * max(1, len(i.fork_ids)) for i in out.scheduled if i.sample}
    s.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    return {i.seq_id: i.num_new_tokens for i in out.scheduled}


def batch_of(s, k, prompt_len=8, max_tokens=40, **kw):
    seqs = [
        add(s, f"b{j}", prompt_len, max_tokens, PRIORITY_BATCH, "lines", **kw) for j in range(k)
    ]
    step(s)  # their prompts
    return seqs


def test_an_interactive_prefill_takes_its_step_without_the_batch_decodes():
    s = scheduler(tenant_prefill_tokens=8)  # shared between two tenants: 8 tokens of prefill
    batch = batch_of(s, 3)
    assert step(s) == {"b0": 1, "b1": 1, "b2": 1}
    add(s, "i", 24, tenant="user")
    # the whole prompt in one step: the batch tenant neither shares the step nor caps it
    assert step(s) == {"i": 24}
    assert all(b.status is SequenceStatus.RUNNING and s.kv.get_block_ids(b.seq_id) for b in batch)
    assert step(s) == {"i": 1, "b0": 1, "b1": 1, "b2": 1}  # its decodes share the step


def test_batch_sequences_sit_out_a_bounded_number_of_steps_and_resume_when_interactive_pauses():
    s = scheduler(tokens=16)
    batch = batch_of(s, 2, max_tokens=30)
    add(s, "i", 150, max_tokens=3, tenant="user")  # a prompt of 10 chunks
    with_batch = []
    while s.seqs["i"].num_output_tokens == 0:
        with_batch.append("b0" in step(s))
    longest, run = 0, 0
    for joined in with_batch:
        run = 0 if joined else run + 1
        longest = max(longest, run)
    assert longest == BATCH_MAX_SIT_OUT and any(with_batch)
    for _ in range(5):  # interactive traffic pauses: the batch runs in every step
        assert {"b0", "b1"} <= step(s).keys()
    while s.seqs:
        step(s)
    assert all(b.finish_reason == "length" and b.num_output_tokens == 30 for b in batch)
    assert s.kv.pool.num_used == 0


def test_a_stream_of_interactive_prompts_cannot_stall_the_batch_forever():
    s = scheduler()
    batch_of(s, 2, max_tokens=200)
    progress = []
    for k in range(30):  # a new interactive prompt every step
        add(s, f"i{k}", 12, max_tokens=2, tenant="user")
        before = s.seqs["b0"].num_output_tokens
        step(s)
        progress.append(s.seqs["b0"].num_output_tokens - before)
    assert sum(progress) == 30 // (BATCH_MAX_SIT_OUT + 1)
    assert max(len(r) for r in "".join(map(str, progress)).split("1")) == BATCH_MAX_SIT_OUT


def test_within_batch_yield_s_a_batch_step_prefills_at_most_tenant_prefill_tokens():
    for yield_s, most in ((1e9, 16), (0.0, 64)):
        s = scheduler(tokens=64, tenant_prefill_tokens=16, batch_yield_s=yield_s)
        add(s, "i", 6, max_tokens=1, tenant="user")
        step(s)  # the interactive request ran and finished: its arrival is recent
        for j in range(8):
            add(s, f"b{j}", 8, 4, PRIORITY_BATCH, "lines")
        assert sum(step(s).values()) == most


def test_an_interactive_request_gets_an_adapter_slot_held_by_batch_sequences():
    disk = {d: make_adapter(d, 2, 1.0) for d in ("batch-adapter", "chat-adapter")}
    slots = LoRAManager(
        SHAPES,
        max_loras=1,
        max_cpu_loras=2,
        max_rank=8,
        device=torch.device("cpu"),
        dtype=torch.float32,
        loader=disk.__getitem__,
    )
    s = scheduler(lora_manager=slots)
    batch = batch_of(s, 3, max_tokens=40, lora="batch-adapter")
    step(s)
    assert slots.slot_of("batch-adapter") is not None and slots.slots_in_use == 1
    add(s, "i", 10, max_tokens=4, tenant="user", lora="chat-adapter")
    assert step(s) == {"i": 10}  # the batch lines gave the only slot up, in this step
    assert all(b.status is SequenceStatus.PREEMPTED for b in batch)
    while s.seqs:
        step(s)
    assert all(b.num_output_tokens == 40 for b in batch)  # they resumed and finished
    assert slots.slots_in_use == 0 and s.kv.pool.num_used == 0


def trace(s, arrivals, steps=200):
    """The steps' ``(seq_id, start, tokens, sample)`` and preemptions, requests added on cue."""
    lines = []
    for k in range(steps):
        for args in arrivals.get(k, ()):
            add(s, *args[:2], max_tokens=args[2], tenant=args[3], n=args[4])
        out = s.schedule()
        if out.is_empty() and not s.seqs:
            break
        lines.append(
            (
                sorted((i.seq_id, i.start, i.num_new_tokens, i.sample) for i in out.scheduled),
                sorted(out.preempted),
            )
        )
        sampled = {i.seq_id: [7] * max(1, len(i.fork_ids)) for i in out.scheduled if i.sample}
        s.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    return repr(lines)


#: sha256 of :func:`trace` for :func:`test_a_schedule_without_batch_requests_is_unchanged`,
#: recorded with the scheduler before the priority passes (main at 676d1eb).
INTERACTIVE_TRACE_SHA256 = "98e1a15db902961beeed70fe18809ee26284279c138870def1341bfbea676393"


def test_a_schedule_without_batch_requests_is_unchanged():
    """Tenants, chunked prefill, the tenant cap, a short pool (preemption), an ``n = 2`` fork."""
    s = scheduler(
        num_blocks=40,
        max_num_seqs=4,
        tokens=32,
        long_prefill_token_threshold=24,
        tenant_prefill_tokens=16,
        attention_cost=1 / 300,
    )
    arrivals = {
        0: [("a0", 40, 12, "a", 1), ("a1", 9, 20, "a", 2), ("b0", 70, 6, "b", 1)],
        3: [("c0", 5, 30, "c", 1), ("a2", 33, 9, "a", 1)],
        7: [("b1", 18, 14, "b", 1), ("c1", 60, 5, "c", 1), ("a3", 3, 25, None, 1)],
        15: [("b2", 26, 11, "b", 2)],
    }
    got = trace(s, arrivals)
    assert hashlib.sha256(got.encode()).hexdigest() == INTERACTIVE_TRACE_SHA256, got
    assert s.num_preemptions > 0 and "#1" in got  # the short pool and the fork were exercised
