"""The usage writer: durable before the response (spool group commit), batches, outages,
refused rows set aside, flush, close and replay.

``test_pg.py`` runs these again on PostgreSQL.
"""

import asyncio
import json
import logging
import time

import pytest
from sqlalchemy import func, select

from loraplex.gateway.db.models import UsageEvent
from loraplex.gateway.services.tenants import create_tenant_with_key
from loraplex.gateway.usage.records import UsageRecord
from loraplex.gateway.usage.spool import UsageSpool, read_segment
from loraplex.gateway.usage.writer import UsageUnavailable, UsageWriter
from tests.gateway.conftest import SECRET, with_db


async def _tenant(sessions):
    async with sessions.begin() as s:
        tenant, key = await create_tenant_with_key(s, "acme", SECRET)
    return tenant.id, key.id


def _record(tenant_id, key_id, i, **fields):
    return UsageRecord(
        request_id=f"req-{i}",
        tenant_id=tenant_id,
        key_id=key_id,
        model="m",
        prompt_tokens=i,
        **fields,
    )


async def _rows(sessions):
    async with sessions() as s:
        return await s.scalar(select(func.count()).select_from(UsageEvent))


async def _all(sessions):
    async with sessions() as s:
        return (await s.scalars(select(UsageEvent).order_by(UsageEvent.id))).all()


def _spool_records(directory):
    found = []
    for path in sorted(directory.glob("*.spool")):
        found.extend(read_segment(path)[0])
    return found


def writer(sessions, tmp_path, **kwargs):
    """A writer with its spool in ``tmp_path / "spool"`` (as ``loraplex serve`` has)."""
    kwargs.setdefault("dead_letter", tmp_path / "dead-letter.jsonl")
    return UsageWriter(sessions, spool=UsageSpool(tmp_path / "spool"), **kwargs)


class SlowSessions:
    """The real session factory, each transaction made ``delay`` seconds slower.

    ``fail`` transactions fail as an unreachable database would (``ConnectionError``).
    """

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


def test_steady_load_is_written_in_few_transactions(database_url, tmp_path):
    """Events arriving while a transaction runs wait for the next window, not a write each."""

    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        slow = SlowSessions(sessions, 0.02)
        w = writer(slow, tmp_path, flush_seconds=0.05)
        w.start()
        began = time.monotonic()
        for i in range(200):  # 200 events over >= 0.4 s: one every 2 ms or so
            w.submit(_record(tenant_id, key_id, i))
            await asyncio.sleep(0.002)
        elapsed = time.monotonic() - began
        await w.flush()
        rows = await _rows(sessions)
        transactions = w.transactions
        await w.close()
        return rows, transactions, elapsed

    rows, transactions, elapsed = with_db(database_url, body)
    assert rows == 200
    # A window of 0.05 s then a 0.02 s write: about one transaction per 0.07 s of load.
    # Chasing each event with its own transaction (the old behaviour) took one per 0.02 s write.
    assert transactions <= elapsed / 0.05 + 2, (transactions, elapsed)


def test_a_record_is_in_the_spool_when_its_future_completes(database_url, tmp_path):
    """Durable before the response: the future completes after the fdatasync, not before;
    records submitted together share one sync (group commit)."""

    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        w = writer(sessions, tmp_path, flush_seconds=30)  # the database write never happens
        w.start()
        first = w.submit(_record(tenant_id, key_id, 0))
        assert not first.done()  # nothing is durable at submit
        await first
        in_spool = [r.request_id for r in _spool_records(tmp_path / "spool")]
        futures = [w.submit(_record(tenant_id, key_id, i)) for i in range(1, 51)]
        await asyncio.gather(*futures)
        syncs_for_50 = w.syncs - 1
        on_disk = len(_spool_records(tmp_path / "spool"))
        rows_before_flush = await _rows(sessions)
        await w.close()
        return in_spool, syncs_for_50, on_disk, rows_before_flush, await _rows(sessions)

    in_spool, syncs_for_50, on_disk, rows_before_flush, rows = with_db(database_url, body)
    assert in_spool == ["req-0"]
    assert 1 <= syncs_for_50 <= 2  # one batch (two if the first sync was still running)
    assert on_disk == 51 and rows_before_flush == 0 and rows == 51
    assert list((tmp_path / "spool").glob("*.spool")) == []  # all written: compacted


def test_flush_returns_once_earlier_events_are_written(database_url, tmp_path):
    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        w = writer(sessions, tmp_path, flush_seconds=30)  # the window never ends by itself
        w.start()
        await w.flush()  # nothing submitted: returns at once
        for i in range(5):
            w.submit(_record(tenant_id, key_id, i))
        await asyncio.wait_for(w.flush(), 5)  # skips the 30 s window
        rows = await _rows(sessions)
        await w.close()
        return rows, w.pending

    assert with_db(database_url, body) == (5, 0)


def test_flush_waits_only_for_events_before_it_under_load(database_url, tmp_path):
    """A flush does not wait for events submitted after it (it would never end under load)."""

    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        w = writer(SlowSessions(sessions, 0.01), tmp_path, flush_seconds=0.05)
        w.start()
        w.submit(_record(tenant_id, key_id, 0))
        flushed = asyncio.ensure_future(w.flush())
        for i in range(1, 50):
            w.submit(_record(tenant_id, key_id, i))
            await asyncio.sleep(0.001)
            if flushed.done():
                break
        await asyncio.wait_for(flushed, 5)
        written_at_flush = w.written
        await w.close()
        return written_at_flush, await _rows(sessions), w.submitted

    written_at_flush, rows, submitted = with_db(database_url, body)
    assert written_at_flush >= 1 and rows == submitted


@pytest.mark.slow
def test_an_outage_keeps_rows_fails_flushes_fast_and_writes_them_after(
    database_url, tmp_path, caplog
):
    """Unreachable: requests stay durable (spool), GET /v1/usage gets 503 at once instead of
    hanging, one log line for the outage and one for its end, then every row is written."""

    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        slow = SlowSessions(sessions, 0.0)
        slow.fail = 4  # four failed attempts (0.1 + 0.2 + 0.4 s of back-off), then it is back
        w = writer(slow, tmp_path, flush_seconds=0.01)
        w.start()
        durable = [w.submit(_record(tenant_id, key_id, i)) for i in range(3)]
        await asyncio.gather(*durable)  # the spool does not need the database
        with pytest.raises(UsageUnavailable) as info:
            await asyncio.wait_for(w.flush(), 5)
        outage = w.outage_since is not None
        deadline = time.monotonic() + 10
        while w.written < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.wait_for(w.flush(), 5)
        rows = await _rows(sessions)
        await w.close()
        return info.value, outage, rows, slow.fail, w.outage_since

    with caplog.at_level(logging.WARNING, logger="loraplex.gateway.usage.writer"):
        error, outage, rows, left, after = with_db(database_url, body)
    assert error.status == 503 and error.headers["Retry-After"] == "2"
    assert outage and rows == 3 and left == 0 and after is None
    lines = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in line for line in lines) == 1, lines
    assert sum("reachable again" in line for line in lines) == 1, lines
    assert not any(r.exc_info for r in caplog.records)  # no traceback per attempt


def test_a_refused_row_is_set_aside_and_never_blocks_the_others(database_url, tmp_path, caplog):
    """The database refuses two rows of a batch (no such tenant: a foreign key): they go to
    the dead letter with one log line each, every other row is written, nothing is retried."""

    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        w = writer(sessions, tmp_path, flush_seconds=30)
        w.start()
        for i in range(10):
            bad = i in (3, 7)
            w.submit(_record("no-such-tenant" if bad else tenant_id, None if bad else key_id, i))
        await asyncio.wait_for(w.flush(), 10)
        later = w.submit(_record(tenant_id, key_id, 10))
        await later
        await asyncio.wait_for(w.flush(), 10)
        rows = [r.request_id for r in await _all(sessions)]
        await w.close()
        return rows, w.dead_lettered

    with caplog.at_level(logging.ERROR, logger="loraplex.gateway.usage.writer"):
        rows, dead = with_db(database_url, body)
    assert rows == [f"req-{i}" for i in range(11) if i not in (3, 7)]
    assert dead == 2
    dead_letter = (tmp_path / "dead-letter.jsonl").read_text().splitlines()
    letters = [json.loads(line) for line in dead_letter]
    assert [d["record"]["request_id"] for d in letters] == ["req-3", "req-7"]
    assert all(d["record"]["tenant_id"] == "no-such-tenant" and d["error"] for d in letters)
    refused = [r for r in caplog.records if "refused by the database" in r.getMessage()]
    assert len(refused) == 2 and not any(r.exc_info for r in refused)
    assert (tmp_path / "dead-letter.jsonl").stat().st_mode & 0o777 == 0o600


def test_strings_are_made_storable(database_url, tmp_path):
    """NUL, a lone surrogate and an over-long value: stored (replaced, cut), not refused."""

    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        w = writer(sessions, tmp_path)
        w.start()
        model = "bad\x00name\ud800" + "x" * 300
        await w.submit(
            _record(tenant_id, key_id, 0, error_type="e\x00", client_request_id="c\x00d")
        )
        w.submit(UsageRecord(request_id="req-1", tenant_id=tenant_id, model=model))
        await w.flush()
        rows = await _all(sessions)
        await w.close()
        return rows, w.dead_lettered

    rows, dead = with_db(database_url, body)
    assert dead == 0
    assert (rows[0].error_type, rows[0].client_request_id) == ("e\ufffd", "c\ufffdd")
    assert rows[1].model.startswith("bad\ufffdname?x") and len(rows[1].model) == 256


def test_close_writes_everything_and_a_rewritten_record_counts_once(database_url, tmp_path):
    """The same server id written twice (a replay after a crash) is one row."""

    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        w = writer(sessions, tmp_path, flush_seconds=30)
        w.start()
        for i in (0, 1, 1, 2):
            w.submit(_record(tenant_id, key_id, i))
        await w.close()
        late = UsageWriter(sessions)  # never started: flush writes in the caller
        late.submit(_record(tenant_id, key_id, 3))
        await late.flush()
        return await _rows(sessions), w.pending, late.pending

    assert with_db(database_url, body) == (4, 0, 0)


def test_rows_the_database_cannot_take_at_shutdown_are_written_at_the_next_start(
    database_url, tmp_path
):
    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        slow = SlowSessions(sessions, 0.0)
        w = writer(slow, tmp_path, flush_seconds=30)
        w.start()
        for i in range(3):
            await w.submit(_record(tenant_id, key_id, i))
        slow.fail = 10**6  # the database is gone for the rest of this run
        flushed = asyncio.ensure_future(w.flush())
        await asyncio.sleep(0.05)
        await w.close()  # never raises
        with pytest.raises(UsageUnavailable):
            await flushed
        kept = len(_spool_records(tmp_path / "spool"))
        rows_then = await _rows(sessions)

        again = writer(sessions, tmp_path, flush_seconds=0.01)  # the next start
        again.start()
        await again.flush()
        await again.close()
        return kept, rows_then, again.replayed, await _rows(sessions)

    kept, rows_then, replayed, rows = with_db(database_url, body)
    assert (kept, rows_then, replayed, rows) == (3, 0, 3, 3)
    assert list((tmp_path / "spool").glob("*")) == []  # compacted, lock released


def test_without_a_spool_durable_means_committed(database_url, tmp_path):
    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        slow = SlowSessions(sessions, 0.0)
        w = UsageWriter(slow, flush_seconds=30)
        w.start()
        await asyncio.wait_for(w.submit(_record(tenant_id, key_id, 0)), 5)  # no 30 s window
        committed = await _rows(sessions)
        slow.fail = 10**6
        with pytest.raises(UsageUnavailable):
            await asyncio.wait_for(w.submit(_record(tenant_id, key_id, 1)), 5)
        slow.fail = 0
        await w.close()
        return committed, await _rows(sessions)

    assert with_db(database_url, body) == (1, 2)


def test_a_failed_spool_write_waits_for_the_database_instead(database_url, tmp_path, caplog):
    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        w = writer(sessions, tmp_path, flush_seconds=30)
        w.start()
        spool = w._spool

        def disk_full(data, last_seq):
            raise OSError(28, "No space left on device")

        spool.write = disk_full
        await asyncio.wait_for(w.submit(_record(tenant_id, key_id, 0)), 5)
        rows = await _rows(sessions)  # durable because committed
        await w.close()
        return rows

    with caplog.at_level(logging.ERROR, logger="loraplex.gateway.usage.writer"):
        assert with_db(database_url, body) == 1
    assert any("spool write failed" in r.getMessage() for r in caplog.records)


def test_the_backlog_limit_refuses_new_work(database_url, tmp_path):
    async def body(sessions):
        tenant_id, key_id = await _tenant(sessions)
        slow = SlowSessions(sessions, 0.0)
        slow.fail = 10**6
        w = writer(slow, tmp_path, flush_seconds=0.01, backlog_limit=3)
        w.start()
        w.admit()
        for i in range(3):
            await w.submit(_record(tenant_id, key_id, i))
        with pytest.raises(UsageUnavailable) as info:
            w.admit()
        slow.fail = 0
        await w.close()
        return info.value

    error = with_db(database_url, body)
    assert error.status == 503 and error.code == "usage_backlog_full"


def test_a_malformed_record_is_refused_at_submit(database_url, tmp_path):
    from loraplex.gateway.services.errors import InvalidInputError

    async def body(sessions):
        w = writer(sessions, tmp_path)
        with pytest.raises(InvalidInputError):
            w.submit(UsageRecord(request_id="r", tenant_id="t", model="m", status="weird"))
        return w.pending

    assert with_db(database_url, body) == 0
