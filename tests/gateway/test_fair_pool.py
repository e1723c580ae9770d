"""FairWorkerPool: one tenant's queue of expensive jobs never holds another tenant's job back.

Jobs block on events the test releases, so the order of starts is exact, not timed.
"""

import asyncio
import threading

import pytest

from loraplex.engine.client.fair_pool import FairWorkerPool, PoolBusyError


class Gate:
    """Jobs that record when they start and wait for the test to release them."""

    def __init__(self):
        self.started: list[str] = []
        self.lock = threading.Lock()
        self.events: dict[str, threading.Event] = {}

    def job(self, name: str):
        event = self.events.setdefault(name, threading.Event())

        def run():
            with self.lock:
                self.started.append(name)
            assert event.wait(10)
            return name

        return run

    def release(self, name: str):
        self.events.setdefault(name, threading.Event()).set()


async def until(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_a_flooding_tenant_holds_at_most_workers_minus_one():
    async def main():
        pool = FairWorkerPool(2)
        gate = Gate()
        flood = [asyncio.ensure_future(pool.run("a", gate.job(f"a{i}"))) for i in range(6)]
        await until(lambda: gate.started == ["a0"])
        await asyncio.sleep(0.05)
        assert gate.started == ["a0"] and pool.running_of("a") == 1  # one worker kept free
        late = asyncio.ensure_future(pool.run("b", gate.job("b0")))
        await until(lambda: gate.started == ["a0", "b0"])  # at once, on the free worker
        gate.release("b0")
        assert await late == "b0"
        for i in range(6):
            gate.release(f"a{i}")
        assert await asyncio.gather(*flood) == [f"a{i}" for i in range(6)]
        pool.shutdown()

    asyncio.run(main())


def test_turns_alternate_between_tenants_in_round_robin():
    async def main():
        pool = FairWorkerPool(1)
        gate = Gate()
        futures = [asyncio.ensure_future(pool.run("a", gate.job(f"a{i}"))) for i in range(3)]
        await until(lambda: gate.started == ["a0"])
        futures += [asyncio.ensure_future(pool.run("b", gate.job(f"b{i}"))) for i in range(2)]
        futures += [asyncio.ensure_future(pool.run("c", gate.job("c0")))]
        await asyncio.sleep(0)
        for name in ["a0", "a1", "b0", "c0", "a2", "b1"]:
            await until(lambda name=name: name in gate.started)
            gate.release(name)
        await asyncio.gather(*futures)
        # a0 was running when b and c arrived; then one job per tenant per turn.
        assert gate.started == ["a0", "a1", "b0", "c0", "a2", "b1"]
        pool.shutdown()

    asyncio.run(main())


def test_a_cancelled_waiting_job_never_runs_and_frees_its_place():
    async def main():
        pool = FairWorkerPool(1, max_queued_per_tenant=2)
        gate = Gate()
        first = asyncio.ensure_future(pool.run("a", gate.job("a0")))
        await until(lambda: gate.started == ["a0"])
        queued = [asyncio.ensure_future(pool.run("a", gate.job(f"a{i}"))) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(PoolBusyError):
            await pool.run("a", gate.job("a3"))
        queued[0].cancel()
        await asyncio.sleep(0)
        again = asyncio.ensure_future(pool.run("a", gate.job("a4")))  # its place is free
        for name in ("a0", "a2", "a4"):
            gate.release(name)
        await asyncio.gather(first, queued[1], again)
        assert "a1" not in gate.started and pool.waiting == 0
        pool.shutdown()

    asyncio.run(main())


def test_errors_reach_the_caller_and_the_worker_is_freed():
    async def main():
        pool = FairWorkerPool(1)

        def boom():
            raise ValueError("bad image")

        with pytest.raises(ValueError, match="bad image"):
            await pool.run("a", boom)
        assert await pool.run("a", lambda: 7) == 7
        pool.shutdown()

    asyncio.run(main())
