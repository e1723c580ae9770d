"""The verified-key cache: one database read per key at once, revocation never undone by a read."""

import asyncio

import pytest

from loraplex.gateway.auth.key_cache import KeyCache
from loraplex.gateway.auth.principals import TenantPrincipal
from loraplex.gateway.services.tenants import TenantLimits

PRINCIPAL = TenantPrincipal("t1", "acme", "k1", TenantLimits(None, None, None))


def loader(reads: list, gate: asyncio.Event, result=PRINCIPAL):
    async def load():
        reads.append(1)
        await gate.wait()
        if isinstance(result, Exception):
            raise result
        return result

    return load


@pytest.mark.parametrize("ttl", [2.0, 0.0])
def test_concurrent_misses_share_one_read(ttl):
    async def main():
        cache, reads, gate = KeyCache(ttl), [], asyncio.Event()
        waiters = [
            asyncio.ensure_future(cache.resolve("h", loader(reads, gate))) for _ in range(32)
        ]
        await asyncio.sleep(0)
        gate.set()
        got = await asyncio.gather(*waiters)
        assert got == [PRINCIPAL] * 32 and len(reads) == 1
        return cache.get("h")

    assert asyncio.run(main()) == (PRINCIPAL if ttl else None)  # ttl 0: nothing is cached


def test_ttl_zero_reads_every_time():
    async def main():
        cache, reads, gate = KeyCache(0), [], asyncio.Event()
        gate.set()
        for _ in range(3):
            assert await cache.resolve("h", loader(reads, gate)) == PRINCIPAL
        return reads

    assert len(asyncio.run(main())) == 3


def test_unknown_key_is_shared_but_never_cached():
    async def main():
        cache, reads, gate = KeyCache(2.0), [], asyncio.Event()
        gate.set()
        first = await asyncio.gather(
            *(cache.resolve("h", loader(reads, gate, None)) for _ in range(4))
        )
        second = await cache.resolve("h", loader(reads, gate, None))
        return first, second, reads

    first, second, reads = asyncio.run(main())
    assert first == [None] * 4 and second is None and len(reads) == 2


@pytest.mark.parametrize("forget", ["key", "tenant"])
def test_a_revocation_during_the_read_is_not_undone(forget):
    async def main():
        cache, reads, gate = KeyCache(2.0), [], asyncio.Event()
        waiter = asyncio.ensure_future(cache.resolve("h", loader(reads, gate)))
        await asyncio.sleep(0)
        cache.forget_key("k1") if forget == "key" else cache.forget_tenant("t1")
        gate.set()
        assert await waiter == PRINCIPAL  # the read began before the revocation
        return cache.get("h")

    assert asyncio.run(main()) is None  # ... but its answer was not cached


def test_a_failed_read_reaches_every_waiter_and_is_retried():
    async def main():
        cache, reads, gate = KeyCache(2.0), [], asyncio.Event()
        boom = RuntimeError("database down")
        waiters = [
            asyncio.ensure_future(cache.resolve("h", loader(reads, gate, boom))) for _ in range(3)
        ]
        await asyncio.sleep(0)
        gate.set()
        got = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(g is boom for g in got) and len(reads) == 1
        ok = asyncio.Event()
        ok.set()
        return await cache.resolve("h", loader(reads, ok)), reads

    principal, reads = asyncio.run(main())
    assert principal == PRINCIPAL and len(reads) == 2


def test_a_cancelled_waiter_does_not_cancel_the_others():
    async def main():
        cache, reads, gate = KeyCache(2.0), [], asyncio.Event()
        first = asyncio.ensure_future(cache.resolve("h", loader(reads, gate)))
        second = asyncio.ensure_future(cache.resolve("h", loader(reads, gate)))
        await asyncio.sleep(0)
        first.cancel()  # the first client went away while its read was in flight
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        return await second, reads, cache.get("h")

    got, reads, cached = asyncio.run(main())
    assert got == PRINCIPAL and cached == PRINCIPAL and len(reads) == 1


def test_a_stale_entry_answers_at_once_while_one_read_refreshes_it():
    async def main():
        cache, reads, gate = KeyCache(0.05), [], asyncio.Event()
        cache.put("h", PRINCIPAL)
        await asyncio.sleep(0.06)  # stale now, within the second ttl
        assert cache.get("h") is None
        # The read is held closed: the stale answers still come at once, one read in flight.
        got = [await cache.resolve("h", loader(reads, gate)) for _ in range(5)]
        await asyncio.sleep(0)  # let the background read begin
        assert got == [PRINCIPAL] * 5 and len(reads) == 1
        gate.set()
        await asyncio.sleep(0.01)
        return cache.get("h"), reads

    fresh, reads = asyncio.run(main())
    assert fresh == PRINCIPAL and len(reads) == 1  # refreshed: fresh again


def test_a_key_revoked_in_the_database_stops_after_the_background_read():
    async def main():
        cache, reads, gate = KeyCache(0.05), [], asyncio.Event()
        gate.set()
        cache.put("h", PRINCIPAL)
        await asyncio.sleep(0.06)
        stale = await cache.resolve("h", loader(reads, gate, None))  # revoked elsewhere
        await asyncio.sleep(0.01)  # the background read found it gone
        after = await cache.resolve("h", loader(reads, gate, None))
        return stale, after, reads

    stale, after, reads = asyncio.run(main())
    assert stale == PRINCIPAL and after is None and len(reads) == 2


def test_past_the_stale_window_a_read_is_awaited():
    async def main():
        cache, reads, gate = KeyCache(0.02), [], asyncio.Event()
        cache.put("h", PRINCIPAL)
        await asyncio.sleep(0.05)  # beyond twice the ttl
        waiter = asyncio.ensure_future(cache.resolve("h", loader(reads, gate, None)))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # no stale answer any more
        gate.set()
        return await waiter

    assert asyncio.run(main()) is None


def test_a_failed_background_refresh_keeps_the_stale_entry(caplog):
    async def main():
        cache, reads, gate = KeyCache(0.05), [], asyncio.Event()
        gate.set()
        cache.put("h", PRINCIPAL)
        await asyncio.sleep(0.06)
        first = await cache.resolve("h", loader(reads, gate, RuntimeError("database down")))
        await asyncio.sleep(0.01)
        second = await cache.resolve("h", loader(reads, gate))  # stale still, read again
        return first, second, reads

    first, second, reads = asyncio.run(main())
    assert first == second == PRINCIPAL and len(reads) == 2
    assert "database down" in caplog.text


def test_a_request_after_a_revocation_does_not_join_a_read_begun_before_it():
    async def main():
        cache, reads = KeyCache(2.0), []
        before_gate, after_gate = asyncio.Event(), asyncio.Event()
        before = asyncio.ensure_future(cache.resolve("h", loader(reads, before_gate)))
        await asyncio.sleep(0)
        cache.forget_key("k1")  # DELETE /admin/keys/{id}: 401 from then on
        after = asyncio.ensure_future(cache.resolve("h", loader(reads, after_gate, None)))
        await asyncio.sleep(0)
        after_gate.set()
        before_gate.set()  # the old read ends last: it must not unregister the new one
        return await before, await after, reads, cache.get("h")

    before, after, reads, cached = asyncio.run(main())
    assert before == PRINCIPAL and after is None and len(reads) == 2 and cached is None


def test_an_unreachable_database_serves_a_recently_verified_key():
    """stale-if-error: past its stale window an entry still answers while the database is
    unreachable, within ``stale_if_error``; any other failure, or an older entry, fails."""
    from loraplex.gateway.db.errors import DatabaseUnavailable

    async def main():
        gate = asyncio.Event()
        gate.set()
        cache = KeyCache(0.02, stale_if_error=0.3)
        cache.put("h", PRINCIPAL)
        await asyncio.sleep(0.05)  # past fresh (0.02) and stale (0.02 more)
        down = loader([], gate, DatabaseUnavailable("connection refused"))
        served = await cache.resolve("h", down)
        with pytest.raises(RuntimeError):  # not an outage: the failure goes to the request
            await cache.resolve("h", loader([], gate, RuntimeError("a bug")))
        with pytest.raises(DatabaseUnavailable):  # never verified: nothing to serve
            await cache.resolve("other", down)
        await asyncio.sleep(0.3)  # past stale_if_error
        with pytest.raises(DatabaseUnavailable):
            await cache.resolve("h", down)
        return served

    assert asyncio.run(main()) == PRINCIPAL
