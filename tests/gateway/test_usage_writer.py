"""The background usage writer: windowed batches under load, flush, retry, close."""

import asyncio
import time

import pytest
from sqlalchemy import func, select

from gateway.db.models import UsageEvent
from gateway.server.usage_writer import UsageWriter
from gateway.services.tenants import create_tenant_with_key
from gateway.services.usage import UsageRecord
from tests.gateway.conftest import SECRET, with_db


async def _tenant(sessions):
    async with sessions.begin() as s:
        tenant, key = await create_tenant_with_key(s, "acme", SECRET)
    return tenant.id, key.id


def _record(tenant_id, key_id, i):
    return UsageRecord(
        request_id=f"req-{i}", tenant_id=tenant_id, key_id=key_id, model="m", prompt_tokens=i
    )


async def _rows(sessions):
    async with sessions() as s:
        return await s.scalar(select(func.count()).select_from(UsageEvent))


class SlowSessions:
    """The real session factory, each transaction made ``delay`` seconds slower."""

    def __init__(self, sessions, delay):
        self.sessions, self.delay, self.fail, self.opened = sessions, delay, 0, 0

    def __call__(self):
        outer = self

        class Slow:
            async def __aenter__(self):
                outer.opened += 1
                await asyncio.sleep(outer.delay)
                if outer.fail:
                    outer.fail -= 1
                    raise ConnectionError("database unreachable")
                self.session = outer.sessions()
                return await self.session.__aenter__()

            async def __aexit__(self, *exc):
                return await self.session.__aexit__(*exc)

        return Slow()


def test_steady_load_is_written_in_few_transactions(database_url):
    """Events arriving while a transaction runs wait for the next window, not a write each."""

    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        slow = SlowSessions(sessions, 0.02)
        writer = UsageWriter(slow, flush_seconds=0.05)
        writer.start()
        began = time.monotonic()
        for i in range(200):  # 200 events over >= 0.4 s: one every 2 ms or so
            writer.submit(_record(tenant_id, key_id, i))
            await asyncio.sleep(0.002)
        elapsed = time.monotonic() - began
        await writer.flush()
        rows, transactions = await _rows(sessions), slow.opened
        await writer.close()
        return rows, transactions, writer.transactions, elapsed

    rows, transactions, counted, elapsed = with_db(database_url, body)
    assert rows == 200 and counted == transactions
    # A window of 0.05 s then a 0.02 s write: about one transaction per 0.07 s of load.
    # Chasing each event with its own transaction (the old behaviour) took one per 0.02 s write.
    assert transactions <= elapsed / 0.05 + 2, (transactions, elapsed)


def test_flush_returns_once_earlier_events_are_written(database_url):
    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        writer = UsageWriter(sessions, flush_seconds=30)  # the window never ends by itself
        writer.start()
        await writer.flush()  # nothing submitted: returns at once
        for i in range(5):
            writer.submit(_record(tenant_id, key_id, i))
        await asyncio.wait_for(writer.flush(), 5)  # skips the 30 s window
        rows = await _rows(sessions)
        await writer.close()
        return rows, writer.pending

    assert with_db(database_url, body) == (5, 0)


def test_flush_waits_only_for_events_before_it_under_load(database_url):
    """A flush does not wait for events submitted after it (it would never end under load)."""

    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        writer = UsageWriter(SlowSessions(sessions, 0.01), flush_seconds=0.05)
        writer.start()
        writer.submit(_record(tenant_id, key_id, 0))
        flushed = asyncio.ensure_future(writer.flush())
        for i in range(1, 50):
            writer.submit(_record(tenant_id, key_id, i))
            await asyncio.sleep(0.001)
            if flushed.done():
                break
        await asyncio.wait_for(flushed, 5)
        written_at_flush = writer.written
        await writer.close()
        return written_at_flush, await _rows(sessions), writer.submitted

    written_at_flush, rows, submitted = with_db(database_url, body)
    assert written_at_flush >= 1 and rows == submitted


def test_failed_writes_are_retried_and_flush_waits_for_them(database_url):
    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        slow = SlowSessions(sessions, 0.0)
        slow.fail = 2  # two failed attempts, then the database is back
        writer = UsageWriter(slow, flush_seconds=0.01)
        writer.start()
        for i in range(3):
            writer.submit(_record(tenant_id, key_id, i))
        await asyncio.wait_for(writer.flush(), 10)  # back-off 0.1 s then 0.2 s
        rows = await _rows(sessions)
        await writer.close()
        return rows, slow.fail

    assert with_db(database_url, body) == (3, 0)


def test_close_writes_everything_and_a_duplicate_id_counts_once(database_url):
    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        writer = UsageWriter(sessions, flush_seconds=30)
        writer.start()
        for i in (0, 1, 1, 2):  # a retried request: same id twice
            writer.submit(_record(tenant_id, key_id, i))
        await writer.close()
        late = UsageWriter(sessions)  # never started: flush writes in the caller
        late.submit(_record(tenant_id, key_id, 3))
        await late.flush()
        return await _rows(sessions), writer.pending, late.pending

    assert with_db(database_url, body) == (4, 0, 0)


def test_close_fails_waiting_flushes_when_the_last_write_fails(database_url):
    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        slow = SlowSessions(sessions, 0.0)
        writer = UsageWriter(slow, flush_seconds=30)
        writer.start()
        writer.submit(_record(tenant_id, key_id, 0))
        slow.fail = 10**6  # the database is gone for good
        flushed = asyncio.ensure_future(writer.flush())
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectionError):
            await writer.close()
        with pytest.raises(RuntimeError, match="closed before writing"):
            await flushed
        return writer.pending

    assert with_db(database_url, body) == 1


def test_a_malformed_record_is_refused_at_submit(database_url):
    from gateway.services.errors import InvalidInputError

    async def body(sessions):
        writer = UsageWriter(sessions)
        with pytest.raises(InvalidInputError):
            writer.submit(UsageRecord(request_id="r", tenant_id="t", model="m", status="weird"))
        return writer.pending

    assert with_db(database_url, body) == 0
