"""The gateway's running-batch slots: shared across tenants round-robin, not first come."""

import asyncio

import pytest

from loraplex.gateway.domains.batches.slots import TenantSlots


def run(coro):
    return asyncio.run(coro)


async def _holders(slots, queue):
    """Queue ``(tenant, name)`` in order; returns the names in the order they got a slot."""
    got = []

    async def one(tenant, name):
        await slots.acquire(tenant)
        got.append(name)

    tasks = []
    for tenant, name in queue:
        tasks.append(asyncio.create_task(one(tenant, name)))
        await asyncio.sleep(0)  # queued in this order
    return got, tasks


def test_one_tenants_batches_do_not_hold_every_slot():
    async def main():
        slots = TenantSlots(2)
        # a queues four batches before b queues one: a FIFO semaphore would run a1..a4 first
        got, tasks = await _holders(
            slots, [("a", "a1"), ("a", "a2"), ("a", "a3"), ("a", "a4"), ("b", "b1")]
        )
        await asyncio.sleep(0)
        assert got == ["a1", "a2"]  # free slots go to whoever asks
        slots.release("a")  # a1 ends: b (no batch running) goes before a3
        await asyncio.sleep(0)
        assert got == ["a1", "a2", "b1"]
        slots.release("a")  # a2 ends: only a waits
        await asyncio.sleep(0)
        assert got == ["a1", "a2", "b1", "a3"]
        assert slots.running == {"a": 1, "b": 1} and slots.waiting("a") == 1
        for task in tasks:
            task.cancel()

    run(main())


def test_round_robin_between_waiting_tenants():
    async def main():
        slots = TenantSlots(1)
        queue = [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("b", "b2"), ("c", "c1")]
        got, tasks = await _holders(slots, queue)
        for tenant in ("a", "b", "c", "a", "b"):  # each grant ends before the next
            await asyncio.sleep(0)
            slots.release(tenant)
        await asyncio.sleep(0)
        assert got == ["a1", "b1", "c1", "a2", "b2", "a3"]
        assert slots.waiting() == 0

    run(main())


def test_a_cancelled_waiter_holds_no_slot():
    async def main():
        slots = TenantSlots(1)
        await slots.acquire("a")
        waiter = asyncio.create_task(slots.acquire("b"))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        later = asyncio.create_task(slots.acquire("c"))
        slots.release("a")
        await asyncio.wait_for(later, 1)
        assert slots.running == {"c": 1} and slots.waiting() == 0

    run(main())
