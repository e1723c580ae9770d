"""Query-of-death bookkeeping (issue 27 item 2; engine/client/quarantine.py): a request present at
two core deaths is refused from then on, in every process sharing the file; a tenant whose requests
keep being there is throttled, bystanders are not; deaths a quarantined request explains are
known as such."""

import json
import threading

import pytest

from loraplex.engine.client import quarantine as quarantine_module
from loraplex.engine.client.quarantine import (
    Quarantine,
    QuarantinePolicy,
    QueryOfDeathError,
    Suspect,
    TenantThrottledError,
    request_digest,
)
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.structured_output.grammar import StructuredOutputSpec


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_the_digest_is_the_content_not_the_id_or_tenant():
    a = EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=5), tenant="t1")
    b = EngineRequest("b", [1, 2, 3], SamplingParams(max_tokens=5), tenant="t2", cache_salt="x")
    assert request_digest(a) == request_digest(b)
    for other in (
        EngineRequest("c", [1, 2, 4], SamplingParams(max_tokens=5)),
        EngineRequest("c", [1, 2, 3], SamplingParams(max_tokens=6)),
        EngineRequest("c", [1, 2, 3], SamplingParams(max_tokens=5, seed=1)),
        EngineRequest("c", [1, 2, 3], SamplingParams(max_tokens=5), lora_digest="ab"),
        EngineRequest(
            "c",
            [1, 2, 3],
            SamplingParams(max_tokens=5, structured_output=StructuredOutputSpec("regex", "a")),
        ),
    ):
        assert request_digest(other) != request_digest(a)


def test_a_request_singled_out_at_two_deaths_is_quarantined(tmp_path):
    q = Quarantine(tmp_path / "q.jsonl")
    killer, bystander = Suspect("k" * 64, "evil"), Suspect("b" * 64, "good")
    first = q.record_death([killer, bystander])  # half of this death each
    q.check(killer.digest, "evil")
    second = q.record_death([killer])  # 1.5: not yet
    q.check(killer.digest, "evil")
    assert not q.explained(first) and not q.explained(second)
    third = q.record_death([killer])  # 2.5
    with pytest.raises(QueryOfDeathError):
        q.check(killer.digest, "someone else")  # the body is refused whoever sends it
    q.check(bystander.digest, "good")
    assert q.explained(first) and q.explained(second) and q.explained(third)
    assert q.stats() == {
        "quarantined_requests": 1,
        "engine_deaths_recorded": 3,
        "quarantine_refusals": 1,
    }


def test_a_culprit_named_by_the_breadcrumb_is_quarantined_at_once(tmp_path):
    q = Quarantine(tmp_path / "q.jsonl")
    culprit, other = Suspect("c" * 64, "evil"), Suspect("o" * 64, "good")
    key = q.record_death([culprit, other], culprits=[culprit])
    assert q.explained(key)
    with pytest.raises(QueryOfDeathError):
        q.check(culprit.digest, None)
    q.check(other.digest, "good")
    assert Quarantine(tmp_path / "q.jsonl").is_quarantined(culprit.digest)  # persisted


def test_an_honest_retry_beside_an_attack_is_not_quarantined(tmp_path):
    # the review's case: each death, the attacker's new body, a bystander's new request and
    # the bystander's retried common body (it retries after every 503) are all fresh
    clock = Clock()
    q = Quarantine(tmp_path / "q.jsonl", QuarantinePolicy(tenant_deaths=3), clock)
    common = Suspect("common", "big")
    for i in range(3):
        q.record_death([Suspect(f"attack{i}", "evil"), Suspect(f"big{i}", "big"), common])
        clock.now += 5
    q.check("common", "big")  # a third of each death: 1 of the 2 it would take
    q.check("anything", "evil")  # half of each death: 1.5 of 3
    for i in range(3, 6):
        q.record_death([Suspect(f"attack{i}", "evil")])  # alone: the attacker's whole
        clock.now += 5
    with pytest.raises(TenantThrottledError):
        q.check("anything", "evil")
    q.check("common", "big")  # the bystander is neither quarantined nor throttled


def test_shared_across_processes_and_restarts(tmp_path):
    path = tmp_path / "q.jsonl"
    a, b = Quarantine(path), Quarantine(path)  # two gateways (or replicas) on one data dir
    a.record_death([Suspect("x" * 64, "t")])
    b.record_death([Suspect("x" * 64, "t")])  # b read a's death first: this is the second
    for q in (a, b, Quarantine(path)):  # and a server started afterwards
        assert q.is_quarantined("x" * 64)
    assert len(path.read_text().splitlines()) == 3  # two deaths, one quarantine


def test_a_malformed_line_is_skipped(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"quarantine": {"digest": "d1", "tenant": null, "time": 1}}\nnot json\n{}\n')
    q = Quarantine(path)
    assert q.is_quarantined("d1")
    path.open("a").write('{"quarantine": {"digest": "d2"')  # a line still being written
    assert not q.is_quarantined("d2")
    path.open("a").write(', "tenant": "t", "time": 2}}\n')
    assert q.is_quarantined("d2")


def test_a_tenant_whose_requests_keep_dying_is_throttled(tmp_path):
    clock = Clock()
    policy = QuarantinePolicy(tenant_deaths=3, throttle_s=60, window_s=3600)
    q = Quarantine(tmp_path / "q.jsonl", policy, clock)
    for i in range(3):  # a new body each time: none is quarantined
        q.check(f"body{i}", "evil")
        q.record_death([Suspect(f"body{i}", "evil")])
        clock.now += 10
    with pytest.raises(TenantThrottledError) as info:
        q.check("body9", "evil")
    assert info.value.retry_after == pytest.approx(50)  # 60 s from the last death, 10 s ago
    q.check("calm", "busy")  # never a suspect
    clock.now += 60
    q.check("body9", "evil")  # the throttle ran out
    q.record_death([Suspect("body9", "evil")])
    with pytest.raises(TenantThrottledError) as info:
        q.check("body10", "evil")
    assert info.value.retry_after == pytest.approx(120)  # doubled per further death
    clock.now += 3601 + 120
    q.check("body10", "evil")  # the deaths left the window


def test_deaths_explained_by_a_quarantined_request_blame_its_tenant_only(tmp_path):
    clock = Clock()
    q = Quarantine(tmp_path / "q.jsonl", QuarantinePolicy(tenant_deaths=2), clock)
    for _ in range(2):  # the same body alone twice: quarantined, both deaths explained by it
        q.record_death([Suspect("qod", "evil")])
    q.record_death([Suspect("qod", "evil"), Suspect("b1", "good"), Suspect("b2", "good")])
    q.check("anything", "good")  # the third death is explained by evil's query: not good's
    with pytest.raises(TenantThrottledError):
        q.check("anything", "evil")


def test_a_disk_that_cannot_be_written_loses_nothing_in_memory(tmp_path):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the directory should be")
    q = Quarantine(blocked / "q.jsonl")
    key = q.record_death([Suspect("x", "t")], culprits=[Suspect("x", "t")])  # no OSError
    assert q.explained(key) and q.is_quarantined("x")
    with pytest.raises(QueryOfDeathError):
        q.check("x", "t")


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "q.jsonl"
    writers = [Quarantine(path) for _ in range(4)]

    def die(q, i):
        for j in range(25):
            q.record_death([Suspect(f"w{i}-{j}", None)])

    threads = [threading.Thread(target=die, args=(q, i)) for i, q in enumerate(writers)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert Quarantine(path).stats()["engine_deaths_recorded"] == 100
    for line in path.read_text().splitlines():
        json.loads(line)


def test_the_file_is_compacted(tmp_path, monkeypatch):
    monkeypatch.setattr(quarantine_module, "COMPACT_LINES", 200)
    path = tmp_path / "q.jsonl"
    q = Quarantine(path, QuarantinePolicy(max_deaths=10))
    q.record_death([Suspect("qod", "t")])
    q.record_death([Suspect("qod", "t")])
    other = Quarantine(path)
    for i in range(quarantine_module.COMPACT_LINES + 5):
        q.record_death([Suspect(f"x{i}", "t")])
    # rewritten once past COMPACT_LINES: the quarantine and the last 10 deaths, then appends
    assert len(path.read_text().splitlines()) < 30
    assert Quarantine(path).is_quarantined("qod")
    assert other.is_quarantined("qod")  # a reader of the old file follows the new one
    other.record_death([Suspect("late", "t")])
    fresh = Quarantine(path, QuarantinePolicy(max_deaths=10))
    assert fresh.stats()["engine_deaths_recorded"] == 10
    assert "late" in path.read_text()


def test_the_suspects_of_a_death_are_what_the_core_took_lately_not_what_arrived_late(
    tmp_path, monkeypatch
):
    # A reader thread that falls behind reads, after the fatal request was sent, outputs the
    # core produced before it took that request. Judged by arrival, the fatal request looked
    # old and shared its blame with every stream in flight; judged by the core's own count
    # (Outputs.taken), it alone is new.
    import time

    from loraplex.engine.client.process import ProcessCoreClient
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.core import wire

    client = ProcessCoreClient(EngineConfig(model="unused"), str(tmp_path / "store"))
    monkeypatch.setattr(client, "_push_now", lambda frame: True)
    client._running, client._last_heard = True, time.monotonic()

    def taken(n):  # what the reader thread does with an Outputs message
        client._taken.append(wire.Outputs([], {}, [], n).taken)

    client.add_request(EngineRequest("stream", [1, 2, 3], SamplingParams(), tenant="good"))
    for _ in range(3):
        taken(1)  # the core took the bystander's stream, and steps it
    client.add_request(EngineRequest("fatal", [4, 5, 6], SamplingParams(), tenant="evil"))
    for _ in range(3):
        taken(1)  # late: produced before the core took "fatal", read after it was sent
    with client._lock:
        suspects = client._suspects()
    assert [s.tenant for s in suspects] == ["evil"]
    taken(2)  # three more steps after the core took it: nothing is fresh any more
    taken(2)
    taken(2)
    with client._lock:
        assert sorted(s.tenant for s in client._suspects()) == ["evil", "good"]  # all in flight
    client._dir.cleanup()
