"""The grammar sandbox (issue 27 item 1): a spec that crashes the native compiler, or takes too
long, costs its own request a refusal in a worker process, never the engine; verdicts are cached
(refusals too) and shared by concurrent requests; tenants take turns."""

import contextlib
import json
import os
import signal
import time

import pytest
from transformers import AutoTokenizer

from loraplex.engine.structured_output.grammar import tokenizer_json
from loraplex.engine.structured_output.sandbox import (
    GrammarSandbox,
    SandboxLimits,
    Verdict,
    _cpu_seconds,
)
from loraplex.engine.structured_output.worker import allows_any


def rule_chain(links: int) -> str:
    """A Lark grammar whose rules chain ``links`` deep: llguidance overflows its stack
    (SIGSEGV) at about 3,000 (the JSON-schema $defs chain of the issue, as a grammar: grammars
    are not bounded structurally, only in the sandbox)."""
    rules = ["start: r0"] + [f'r{i}: r{i + 1} | "x"' for i in range(links)]
    return "\n".join(rules + [f'r{links}: "y"'])


@pytest.fixture(scope="module")
def tokenizer(tiny_text_dir):
    return AutoTokenizer.from_pretrained(tiny_text_dir)


def sandbox_for(tokenizer, **limits) -> GrammarSandbox:
    text = tokenizer_json(tokenizer)
    return GrammarSandbox(
        lambda: text, len(tokenizer), (tokenizer.eos_token_id,), SandboxLimits(**limits)
    )


@pytest.fixture
def sandbox(tokenizer):
    box = sandbox_for(tokenizer)
    yield box
    box.shutdown()


def test_a_crashing_grammar_kills_a_worker_and_nothing_else(sandbox):
    ok = sandbox.vet("json_schema", json.dumps({"type": "object"})).result(30)
    assert ok == Verdict(True, "", ok.seconds)
    first = sandbox.worker_pids
    crashed = sandbox.vet("grammar", rule_chain(3000)).result(30)
    assert not crashed.ok
    assert "crashed the grammar compiler (killed by SIGSEGV)" in crashed.error
    assert sandbox.stats["grammar_worker_deaths"] == 1
    # the next job gets a new worker; this process is untouched
    again = sandbox.vet("regex", "(yes|no)").result(30)
    assert again.ok
    assert sandbox.worker_pids and sandbox.worker_pids != first
    # the refusal is cached: the same spec does not reach a worker again
    cached = sandbox.vet("grammar", rule_chain(3000))
    assert cached.done() and cached.result() == crashed
    assert sandbox.stats["grammar_worker_deaths"] == 1


@pytest.mark.slow
def test_a_grammar_past_its_cpu_time_is_refused(tokenizer):
    box = sandbox_for(tokenizer, cpu_seconds=0.05)
    try:
        slow = box.vet("grammar", "start: /a{1000000}/ /b{1000000}/").result(60)
        assert not slow.ok and "took more than 0.05 s of CPU" in slow.error
        assert box.vet("regex", "ab").result(30).ok  # a fresh worker
    finally:
        box.shutdown()


@pytest.mark.slow
def test_a_grammar_past_the_memory_limit_is_refused(tokenizer):
    # a worker takes ~30 MB of address space; this lexer about 250 MB more
    box = sandbox_for(tokenizer, memory_bytes=128 * 1024**2, cpu_seconds=30)
    try:
        assert box.vet("regex", "ab").result(30).ok  # the worker itself fits
        verdict = box.vet("grammar", "start: /a{2000000}/").result(60)
        assert not verdict.ok
        assert "crashed the grammar compiler (killed by SIGABRT)" in verdict.error
    finally:
        box.shutdown()


def test_grammars_that_allow_no_token_are_refused(sandbox):
    for kind, value in [("json_schema", json.dumps({"$ref": "#"})), ("grammar", "start: start")]:
        verdict = sandbox.vet(kind, value).result(30)
        assert not verdict.ok
        assert "allows no token" in verdict.error or "unsupported" in verdict.error, verdict


def test_concurrent_requests_share_one_job(sandbox):
    spec = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    futures = [sandbox.vet("json_schema", spec, tenant=f"t{i % 3}") for i in range(10)]
    assert len({id(f) for f in futures}) == 1
    assert futures[0].result(30).ok
    assert sandbox.stats["grammar_vetted"] == 1


def test_tenants_take_turns(tokenizer):
    box = sandbox_for(tokenizer)
    order: list[str] = []
    try:
        hold = box.vet("grammar", "start: /a{300000}/")  # occupies the one worker for a while
        flood = [box.vet("regex", f"a{i}", tenant="flood") for i in range(6)]
        other = box.vet("regex", "b", tenant="quiet")
        for i, f in enumerate(flood):
            f.add_done_callback(lambda _f, i=i: order.append(f"flood{i}"))
        other.add_done_callback(lambda _f: order.append("quiet"))
        hold.result(60)
        other.result(60)
        [f.result(60) for f in flood]
        # the quiet tenant's one job went in the flood's first turn, not after all six
        assert order.index("quiet") <= 1, order
    finally:
        box.shutdown()


def test_workers_leave_with_the_sandbox(tokenizer):
    box = sandbox_for(tokenizer, workers=2)
    assert box.vet("regex", "a").result(30).ok
    pids = box.worker_pids
    assert pids
    box.shutdown()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError):
        box.vet("regex", "b")


def test_allows_any():
    assert not allows_any(b"\x00\x00\x80", 23)  # bit 23 is past a 23-id vocabulary
    assert allows_any(b"\x00\x00\x40", 23)
    assert allows_any(b"\x01", 1)
    assert not allows_any(b"", 100)


def test_a_grammar_that_fails_at_its_second_token_is_refused(sandbox):
    # compiles, and its first mask allows "a"; llguidance's lexer gives up on the next one
    verdict = sandbox.vet("grammar", "start: /(a{1000}){1000}/").result(60)
    assert not verdict.ok and "past its first token" in verdict.error, verdict
    assert sandbox.vet("regex", "(yes|no)-[0-9]{3}").result(30).ok


@pytest.mark.slow
def test_what_is_the_machines_fault_is_not_cached(tokenizer):
    box = sandbox_for(tokenizer, cpu_seconds=0.3)  # a 1.8 s wall-clock cap
    try:
        assert box.vet("regex", "warm up").result(30).ok
        slow = "start: /a{900000}/"
        (pid,) = box.worker_pids
        future = box.vet("grammar", slow)
        os.kill(pid, signal.SIGSTOP)  # the worker gets no CPU: only the wall clock runs
        try:
            verdict = future.result(60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert verdict.transient and not verdict.ok
        assert "overloaded" in verdict.error
        again = box.vet("grammar", slow)
        assert not again.done()  # not cached: judged again, by a new worker
        verdict = again.result(60)
        assert not verdict.ok and not verdict.transient  # this time judged on the spec itself
        # a worker killed from outside (the OOM killer) is not the spec's fault either;
        # the one the spec used up is replaced on the next job, so start one first
        assert box.vet("regex", "warm up again").result(30).ok
        (pid,) = box.worker_pids
        busy_from = _cpu_seconds(pid)
        other = box.vet("grammar", "start: /b{900000}/")
        deadline = time.monotonic() + 30
        while _cpu_seconds(pid) < busy_from + 0.05 and time.monotonic() < deadline:
            time.sleep(0.005)  # until the worker is compiling this job
        os.kill(pid, signal.SIGKILL)
        assert other.result(60).transient
    finally:
        box.shutdown()


def test_workers_get_no_secrets(tokenizer, monkeypatch):
    monkeypatch.setenv("LORAPLEX_ADMIN_KEY", "lpx-admin-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "shh")
    box = sandbox_for(tokenizer)
    try:
        assert box.vet("regex", "a").result(30).ok
        (pid,) = box.worker_pids
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
        assert b"lpx-admin-secret" not in environ and b"shh" not in environ
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
    finally:
        box.shutdown()
