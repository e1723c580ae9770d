"""Priority classes: batch sequences get only the capacity interactive ones leave.

An interactive request submitted while a batch holds every slot (and more batch lines wait)
starts at the next step, ahead of the waiting batch lines, by preempting the newest batch
sequence; the preemption changes no token. Checked on the real engine and on the queue.
"""

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import PRIORITY_BATCH, EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.scheduling.fair_queue import FairQueue
from loraplex.engine.sequence import Sequence
from loraplex.hashing.request_hasher import RequestBlockHasher

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
