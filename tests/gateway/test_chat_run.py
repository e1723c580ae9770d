"""ChatRun: the engine run's own task, its client watcher, and the usage it records."""

import asyncio
import threading
from types import SimpleNamespace

import pytest

from bench.fake_engine import InstantEngine
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.gateway.auth.principals import TenantPrincipal
from loraplex.gateway.domains.chat.service import ChatRun
from loraplex.gateway.errors import APIError
from loraplex.gateway.limits.ratelimit import RateLimiter
from loraplex.gateway.services.tenants import TenantLimits
from loraplex.gateway.usage.ledger import UsageLedger

LIMITS = TenantLimits(None, None, None)


class Recorder:
    def __init__(self):
        self.records, self.requests = [], []

    def submit(self, record):
        self.records.append(record)
        durable = asyncio.get_running_loop().create_future()
        durable.set_result(None)
        return durable

    def record_request(self, *args):
        self.requests.append(args)


def make_run(gate=None, tokens=4, deliver=False):
    recorder = Recorder()
    engine = InstantEngine(completion_tokens=tokens, gate=gate)
    state = SimpleNamespace(engine=engine, in_flight=set(), usage=recorder, metrics=recorder)
    state.limiter = RateLimiter()
    principal = TenantPrincipal("t1", "acme", "k1", LIMITS)
    ticket = state.limiter.admit("k1", LIMITS)
    ledger = UsageLedger(state, principal, ticket, "usage-1")
    request = EngineRequest(
        request_id="chatcmpl-1",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=tokens, temperature=0.0),
        cache_salt="t1",
    )
    return ChatRun(state, request, ledger, deliver=deliver), state, recorder


async def never_disconnects():
    """An ASGI receive whose client never leaves (blocks until cancelled)."""
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def test_a_disconnect_cancels_the_run_and_records_it_aborted():
    async def main():
        gate = threading.Event()  # the engine stops after its first token
        run, state, recorder = make_run(gate)
        left = asyncio.Event()

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        run.watch_client(receive)
        first = await run.next()
        left.set()
        with pytest.raises(APIError) as info:
            await run.final()
        await asyncio.sleep(0)
        return first, info.value, run, state, recorder

    first, error, run, state, recorder = asyncio.run(main())
    assert first.outputs[0].token_ids == [42]
    assert error.status == 503 and error.code == "request_aborted" and run.client_left
    (record,) = recorder.records
    assert (record.status, record.error_type) == ("aborted", "client_disconnected")
    assert record.completion_tokens == 1 and record.prompt_tokens == 3
    assert not state.in_flight and state.engine.in_flight == 0


def test_a_finished_run_ends_its_watcher_and_counts_its_last_output_once():
    async def main():
        run, state, recorder = make_run(tokens=5)
        run.watch_client(never_disconnects)
        out = await run.final()
        for _ in range(3):  # the run's done callback cancels the watcher; let that land
            await asyncio.sleep(0)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return out, run, recorder, pending

    out, run, recorder, pending = asyncio.run(main())
    assert out.finished and not run.client_left
    assert pending == []  # the watcher went with the run
    (record,) = recorder.records
    assert (record.status, record.completion_tokens, record.prompt_tokens) == ("ok", 5, 3)


def test_a_watcher_whose_receive_fails_leaves_the_run_alone():
    async def main():
        run, _, recorder = make_run(tokens=3)

        async def receive():
            raise RuntimeError("the server went away")

        run.watch_client(receive)
        await asyncio.sleep(0)
        return await run.final(), run, recorder

    out, run, recorder = asyncio.run(main())
    assert out.finished and not run.client_left
    assert recorder.records[0].status == "ok"


def test_a_finished_run_leaves_no_reference_cycles():
    """Freed by reference counting alone: a cycle per request (the cancelled watcher's
    CancelledError -> traceback -> its frame -> the run -> the watcher) made the garbage
    collector walk ~35 objects per request and, under load, pause the event loop."""
    import gc

    async def main():
        run, _, _ = make_run(tokens=3)
        run.watch_client(never_disconnects)
        await run.final()
        for _ in range(3):
            await asyncio.sleep(0)
        return type(run)

    gc.collect()
    gc.disable()
    try:
        run_type = asyncio.run(main())
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        leftovers = [o for o in gc.garbage if type(o) is run_type]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert leftovers == []


class Admission:
    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


def test_a_delivered_run_records_ok_when_its_last_bytes_go_out_not_when_the_engine_ends():
    """``deliver``: the ``ok`` row waits for the HTTP side's last write; admission control's
    share is free as soon as the engine is done."""

    async def main():
        run, state, recorder = make_run(tokens=3, deliver=True)
        admission = run.ledger.admission = Admission()
        hold = run.ledger.ticket.hold()  # as the connection holds it until written
        run.watch_client(never_disconnects)
        out = await run.final()
        for _ in range(3):
            await asyncio.sleep(0)
        seen = (list(recorder.records), admission.released, run.task.done())
        run.delivered()
        run.delivered()  # once
        run.cancel("client_disconnected")  # too late: a no-op
        in_flight = state.limiter.in_flight("k1")
        hold()
        return out, seen, recorder, in_flight, state.limiter.in_flight("k1")

    out, seen, recorder, held, released = asyncio.run(main())
    assert out.finished
    assert seen == ([], 1, True)  # engine done, admission freed, no row yet
    (record,) = recorder.records
    assert (record.status, record.completion_tokens) == ("ok", 3)
    assert (held, released) == (1, 0)  # the slot waits for the hold, not for the row


def test_a_finished_run_cut_before_its_last_write_is_aborted_with_the_cuts_reason():
    async def main():
        run, state, recorder = make_run(tokens=3, deliver=True)
        run.watch_client(never_disconnects, reason=lambda: "write_timeout")
        await run.final()
        await asyncio.sleep(0)
        run.client_gone()  # the connection was reset at the write deadline
        run.delivered()  # the stream gets there afterwards: nothing changes
        return run, state, recorder

    run, state, recorder = asyncio.run(main())
    (record,) = recorder.records
    assert (record.status, record.error_type) == ("aborted", "write_timeout")
    assert record.completion_tokens == 3  # every token the engine made
    assert run.client_left and state.limiter.in_flight("k1") == 0


def test_a_deferred_run_that_fails_is_recorded_at_once():
    """Only an ``ok`` finish waits for delivery: an error is the engine's to record."""

    async def body():
        recorder = Recorder()
        engine = InstantEngine(completion_tokens=3)

        async def failing(request):
            raise RuntimeError("boom")
            yield  # pragma: no cover - an async generator

        engine.generate = failing
        state = SimpleNamespace(engine=engine, in_flight=set(), usage=recorder, metrics=recorder)
        ticket = RateLimiter().admit("k1", LIMITS)
        ledger = UsageLedger(state, TenantPrincipal("t1", "acme", "k1", LIMITS), ticket, "u")
        request = EngineRequest(
            request_id="chatcmpl-2",
            prompt_token_ids=[1],
            sampling=SamplingParams(max_tokens=3),
            cache_salt="t1",
        )
        run = ChatRun(state, request, ledger, deliver=True)
        with pytest.raises(APIError):
            await run.final()
        return recorder

    (record,) = asyncio.run(body()).records
    assert (record.status, record.error_type) == ("error", "internal_error")
