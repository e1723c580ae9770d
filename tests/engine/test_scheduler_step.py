"""The one-way step contract, driven with a fake runner (no model).

``Scheduler.schedule()`` must tell the runner everything (new sequences whole, then new block
ids and copy-on-write replacements per step), and ``update_from_output`` is the one writer of
tokens and finishes: EOS (unless ``ignore_eos``), stop token ids, ``max_tokens``, the model
length, the ``n > 1`` fork, and a stop string found by the client (``finish_request``).
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.scheduling.budget import PrefillBudget
from loraplex.engine.scheduling.output import ModelRunnerOutput, SchedulerOutput
from loraplex.engine.scheduling.scheduler import Scheduler
from loraplex.engine.sequence import Sequence
from loraplex.hashing.request_hasher import RequestBlockHasher

BLOCK = 4
EOS = 2


class FakeRunner:
    """Keeps block tables only from what ``SchedulerOutput`` says; samples a scripted token."""

    def __init__(self, token=lambda seq_id, step: 7) -> None:
        self.tables: dict[str, list[int]] = {}
        self.token = token
        self.steps = 0

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for seq_id in sched.finished_seq_ids + sched.dropped_seq_ids:
            self.tables.pop(seq_id, None)
        for new in sched.new_seqs:
            self.tables[new.seq_id] = list(new.block_ids)
        for item in sched.scheduled:
            table = self.tables[item.seq_id]
            for logical, block in item.copies:
                table[logical] = block
            table.extend(item.new_block_ids)
        self.steps += 1
        sampled = {}
        for item in sched.scheduled:
            if item.sample:
                ids = item.fork_ids or (item.seq_id,)
                sampled[item.seq_id] = [self.token(i, self.steps) for i in ids]
        return ModelRunnerOutput(sampled=sampled)


def make(max_model_len=10_000, num_blocks=64, **kw) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, BLOCK),
        max_num_seqs=kw.pop("max_num_seqs", 8),
        budget=PrefillBudget(kw.pop("max_num_batched_tokens", 64)),
        max_loras=1,
        max_model_len=max_model_len,
        eos_token_ids=(EOS,),
        **kw,
    )


def add(s: Scheduler, rid: str, prompt_len=6, **params) -> Sequence:
    request = EngineRequest(rid, list(range(10, 10 + prompt_len)), SamplingParams(**params))
    hasher = RequestBlockHasher(BLOCK)
    hasher.extend(request.prompt_token_ids)
    seq = Sequence(rid, request, 0, list(request.prompt_token_ids), hasher)
    s.add(seq)
    return seq


def run(s: Scheduler, runner: FakeRunner, steps=100) -> list:
    outputs = []
    for _ in range(steps):
        sched = s.schedule()
        if sched.is_empty():
            break
        outputs += s.update_from_output(sched, runner.execute(sched))
        for seq_id, table in runner.tables.items():  # the runner's view is the manager's
            if seq_id in s.seqs:
                assert table == s.kv.get_block_ids(seq_id), seq_id
    return outputs


def finishes(outputs) -> dict:
    return {
        (o.request_id, o.index): (o.finish_reason, o.stop_reason)
        for o in outputs
        if o.finish_reason
    }


def test_eos_finishes_with_stop_unless_ignore_eos():
    s = make()
    add(s, "eos", max_tokens=50)
    add(s, "ignore", max_tokens=5, ignore_eos=True)
    outs = run(s, FakeRunner(lambda seq_id, step: EOS if step == 3 else 7))
    assert finishes(outs) == {("eos", 0): ("stop", None), ("ignore", 0): ("length", None)}
    tokens = {}
    for o in outs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert tokens == {"eos": [7, 7, EOS], "ignore": [7, 7, EOS, 7, 7]}
    assert not s.seqs and not s.requests and s.kv.pool.num_used == 0


def test_a_stop_token_id_is_the_stop_reason():
    s = make()
    add(s, "r", max_tokens=50, stop_token_ids=[9])
    outs = run(s, FakeRunner(lambda seq_id, step: 9 if step == 2 else 7))
    assert finishes(outs) == {("r", 0): ("stop", 9)}
    assert outs[-1].request_finished


def test_the_model_length_finishes_with_length():
    s = make(max_model_len=9)
    add(s, "r", prompt_len=6, max_tokens=50)
    outs = run(s, FakeRunner())
    assert finishes(outs) == {("r", 0): ("length", None)}
    assert sum(len(o.new_token_ids) for o in outs) == 3


def test_n_forks_at_the_first_token_and_shares_the_prompt_blocks():
    s = make()
    add(s, "r", prompt_len=6, n=3, max_tokens=4)
    runner = FakeRunner(lambda seq_id, step: 20 + int(seq_id.partition("#")[2] or 0))
    sched = s.schedule()
    assert sched.scheduled[0].fork_ids == ("r", "r#1", "r#2")
    first = s.update_from_output(sched, runner.execute(sched))
    assert [(o.index, o.new_token_ids) for o in first] == [(0, [20]), (1, [21]), (2, [22])]
    tables = [s.kv.get_block_ids(i) for i in ("r", "r#1", "r#2")]
    assert tables[0][0] == tables[1][0] == tables[2][0]  # the full prompt block is shared
    outs = first + run(s, runner)
    assert finishes(outs) == {("r", i): ("length", None) for i in range(3)}
    assert s.kv.pool.num_used == 0 and not s.requests


def test_a_stop_string_from_the_client_finishes_one_fork():
    s = make()
    add(s, "r", n=2, max_tokens=6)
    runner = FakeRunner()
    run(s, runner, steps=2)
    assert [q.seq_id for q in s.requests["r"].seqs] == ["r", "r#1"]
    done = s.finish_request("r", "stop", "###", index=1)
    assert [q.seq_id for q in done] == ["r#1"] and done[0].stop_reason == "###"
    sched = s.schedule()
    assert sched.finished_seq_ids == ["r#1"]  # the runner drops it
    assert [i.seq_id for i in sched.scheduled] == ["r"]
    s.update_from_output(sched, runner.execute(sched))
    outs = run(s, runner)
    assert finishes(outs) == {("r", 0): ("length", None)} and outs[-1].request_finished


def test_a_failed_sequence_fails_its_request_and_its_fresh_blocks_leave_the_cache():
    s = make()
    add(s, "bad", prompt_len=9)
    runner = FakeRunner()
    sched = s.schedule()
    result = runner.execute(sched)
    result.failed["bad"] = "the forward pass"
    outs = s.update_from_output(sched, result)
    assert [(o.finish_reason, o.error, o.request_finished) for o in outs] == [
        ("error", "the request failed in the forward pass", True)
    ]
    assert s.kv.pool.num_used == 0
    hasher = RequestBlockHasher(BLOCK)
    hasher.extend(list(range(10, 19)))
    assert s.kv.get_computed_blocks(hasher.block_hashes, 9).num_cached_tokens == 0


@settings(deadline=None, max_examples=40)
@given(
    lens=st.lists(st.integers(1, 30), min_size=1, max_size=6),
    max_tokens=st.integers(1, 12),
    num_blocks=st.integers(12, 40),
    policy=st.sampled_from(["recompute", "swap"]),
)
def test_the_runners_tables_always_match_the_manager(lens, max_tokens, num_blocks, policy):
    from loraplex.engine.kv_cache.swap import CpuBlockPool

    s = make(
        num_blocks=num_blocks,
        max_num_batched_tokens=16,
        preemption=policy,
        cpu_pool=CpuBlockPool(64) if policy == "swap" else None,
    )
    for i, n in enumerate(lens):
        add(s, f"r{i}", prompt_len=n, max_tokens=max_tokens, n=1 + i % 2)
    outs = run(s, FakeRunner(), steps=400)  # run() compares the tables every step
    assert not s.requests and s.kv.pool.num_used == 0
    got = {(o.request_id, o.index) for o in outs if o.finish_reason}
    assert len(got) == sum(1 + i % 2 for i in range(len(lens)))
