"""Benchmark: the console's usage queries over a month of a busy tenant's rows (issue 33 item 3).

Generates ``--rows`` usage rows for one busy tenant spread over 30 days (six models or
adapters, 2 % errors, 1 % aborted, log-normal latencies) and half as many again for nine other
tenants, in a database at revision 0004 (before the console's migration), and times
``GET /v1/usage``'s query (``usage_summary``) there. Then it migrates to head (0006: the hourly
rollups, backfilled, their trigger, and the covering index ``ix_usage_events_console``),
refreshes the planner's statistics (SQLite ``ANALYZE``, PostgreSQL ``VACUUM ANALYZE``, what
autovacuum does on a live server) and times the console's queries
(``gateway.console.usage_queries``) for that tenant's month: the hourly and daily series with
latency percentiles, the CSV's per-model split, the per-model breakdown, the admin's
all-tenant daily view, and ``usage_summary`` again. It checks that the rollups' totals equal
the rows' own (the trigger's exactness), and times the same rows inserted into a database at
head (the trigger's cost on the usage writer's inserts). Each figure is the median of
``--repeats`` runs, each on a new session.

Run: ``python -m bench.console_usage [--quick] [--rows N] [--pg-url URL]`` (SQLite in a temporary
directory always; PostgreSQL too when a URL is given, e.g. from ``source .ci/postgres.sh``: its
tables are dropped first). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import text

from loraplex.gateway.console.usage_queries import usage_breakdown, usage_buckets
from loraplex.gateway.db.migrate import upgrade_async
from loraplex.gateway.db.models import Tenant, UsageEvent
from loraplex.gateway.db.session import make_engine, session_factory
from loraplex.gateway.usage.records import usage_summary

END = datetime(2026, 11, 1, tzinfo=UTC)
START = END - timedelta(days=30)
MODELS = ["base", "support-bot", "sql-helper", "summarizer", "translator", "classifier"]
OTHER_TENANTS = 9
LIMIT_MS = 200.0
PAGE_QUERIES = ("series_hour_month", "series_day_month", "breakdown_month")
"""What the usage page runs for a month (the CSV export and /v1/usage are reported apart)."""


def rows_for(tenant_id: str, n: int, prefix: str, seed: int) -> list[dict]:
    """``n`` usage rows of one tenant, uniformly over ``[START, END)``."""
    rng = random.Random(seed)
    span = (END - START).total_seconds()
    out = []
    for i in range(n):
        r = rng.random()
        out.append(
            {
                "request_id": f"{prefix}{i}",
                "tenant_id": tenant_id,
                "model": MODELS[min(int(rng.expovariate(0.8)), len(MODELS) - 1)],
                "prompt_tokens": rng.randint(20, 4000),
                "completion_tokens": rng.randint(1, 800),
                "cached_tokens": rng.choice((0, 0, 256, 1024)),
                "images": 1 if r < 0.03 else 0,
                "status": "error" if r < 0.02 else "aborted" if r < 0.03 else "ok",
                "created_at": START + timedelta(seconds=rng.random() * span),
                "latency_ms": rng.lognormvariate(6.5, 0.8),
                "ttft_ms": rng.lognormvariate(4.5, 0.6),
            }
        )
    return out


async def fill(url: str, rows: int, revision: str = "0004") -> tuple[str, float]:
    """Migrate to ``revision``, add the tenants and rows; (busy tenant's id, seconds to insert)."""
    await upgrade_async(url, revision)
    engine = make_engine(url)
    try:
        tenants = [f"{i:032x}" for i in range(OTHER_TENANTS + 1)]
        async with engine.begin() as conn:
            await conn.execute(
                Tenant.__table__.insert(),
                [
                    {"id": t, "name": f"tenant-{i}", "created_at": START}
                    for i, t in enumerate(tenants)
                ],
            )
        batches = [rows_for(tenants[0], rows, "busy-", 0)]
        per_other = max(1, rows // 2 // OTHER_TENANTS)
        batches += [rows_for(t, per_other, f"t{i}-", i) for i, t in enumerate(tenants[1:], 1)]
        t0 = time.perf_counter()
        for batch in batches:
            for at in range(0, len(batch), 20_000):
                async with engine.begin() as conn:
                    await conn.execute(UsageEvent.__table__.insert(), batch[at : at + 20_000])
        return tenants[0], time.perf_counter() - t0
    finally:
        await engine.dispose()


QUERIES = {
    "series_hour_month": lambda s, t: usage_buckets(
        s, tenant_id=t, since=START, until=END, bucket="hour"
    ),
    "series_day_month": lambda s, t: usage_buckets(
        s, tenant_id=t, since=START, until=END, bucket="day"
    ),
    "csv_hour_by_model_month": lambda s, t: usage_buckets(
        s, tenant_id=t, since=START, until=END, bucket="hour", split=True
    ),
    "breakdown_month": lambda s, t: usage_breakdown(s, tenant_id=t, since=START, until=END),
    "v1_usage_month": lambda s, t: usage_summary(s, t, since=START, until=END),
    "admin_all_tenants_day_month": lambda s, t: usage_buckets(
        s, tenant_id=None, since=START, until=END, bucket="day"
    ),
}


async def time_queries(
    url: str, tenant: str, repeats: int, only: tuple[str, ...] | None = None
) -> dict[str, float]:
    """Median milliseconds of each query in :data:`QUERIES` (or ``only`` those) for ``tenant``."""
    engine = make_engine(url)
    sessions = session_factory(engine)
    out = {}
    try:
        for name, query in QUERIES.items():
            if only is not None and name not in only:
                continue
            times = []
            for _ in range(repeats):
                async with sessions() as session:
                    t0 = time.perf_counter()
                    await query(session, None if name.startswith("admin") else tenant)
                    times.append((time.perf_counter() - t0) * 1000)
            out[name] = round(statistics.median(times), 1)
    finally:
        await engine.dispose()
    return out


async def analyze(url: str) -> None:
    """Refresh the planner's statistics (and PostgreSQL's visibility map)."""
    engine = make_engine(url)
    try:
        if url.startswith("postgresql"):
            async with engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                await conn.execute(text("VACUUM ANALYZE usage_events"))
        else:
            async with engine.begin() as conn:
                await conn.execute(text("ANALYZE"))
    finally:
        await engine.dispose()


async def check_exact(url: str, tenant: str) -> bool:
    """Whether the rollups' month totals equal the rows' own (``usage_summary``)."""
    engine = make_engine(url)
    try:
        async with session_factory(engine)() as session:
            days = await usage_buckets(
                session, tenant_id=tenant, since=START, until=END, bucket="day"
            )
            raw = (await usage_summary(session, tenant, since=START, until=END))["totals"]
    finally:
        await engine.dispose()
    return all(sum(d.counts[k] for d in days) == raw[k] for k in raw)


async def run(url: str, rows: int, repeats: int, fresh_url) -> dict:
    """Fill at 0004, time /v1/usage, migrate to head, time everything; the trigger's cost."""
    tenant, insert_s = await fill(url, rows)
    await analyze(url)
    before = await time_queries(url, tenant, repeats, only=("v1_usage_month",))
    t0 = time.perf_counter()
    await upgrade_async(url)
    migrate_s = time.perf_counter() - t0
    await analyze(url)
    after = await time_queries(url, tenant, repeats)
    exact = await check_exact(url, tenant)
    second = await fresh_url()
    _, insert_head_s = await fill(second, rows, "head")
    tenant_queries = [k for k in after if not k.startswith("admin")]
    pages = [k for k in PAGE_QUERIES if k in after]
    return {
        "insert_s_at_0004": round(insert_s, 1),
        "insert_s_at_head": round(insert_head_s, 1),
        "migrate_s": round(migrate_s, 2),
        "before_ms": before,
        "after_ms": after,
        "rollups_exact": exact,
        "tenant_month_max_ms": max(after[k] for k in tenant_queries),
        "pages_max_ms": max(after[k] for k in pages),
        "pages_under_200ms": all(after[k] < LIMIT_MS for k in pages),
    }


async def wipe_pg(url: str) -> None:
    """Drop loraplex's tables from the PostgreSQL database at ``url``."""
    engine = make_engine(url)
    tables = (
        "usage_hourly, usage_hourly_latency, batches, files, stored_responses, usage_events, "
        "adapters, api_keys, tenants, alembic_version"
    )
    try:
        async with engine.begin() as conn:
            await conn.execute(text(f"DROP TABLE IF EXISTS {tables} CASCADE"))
            await conn.execute(text("DROP FUNCTION IF EXISTS usage_events_rollup() CASCADE"))
    finally:
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10,000 rows, 3 repeats")
    parser.add_argument(
        "--rows", type=int, default=300_000, help="the busy tenant's month (10k a day)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pg-url", default=None, help="also on this PostgreSQL (wiped)")
    args = parser.parse_args()
    rows, repeats = (10_000, 3) if args.quick else (args.rows, args.repeats)
    result: dict = {
        "bench": "console_usage",
        "busy_tenant_rows": rows,
        "other_rows": rows // 2 // OTHER_TENANTS * OTHER_TENANTS,
        "days": 30,
    }
    with tempfile.TemporaryDirectory() as tmp:
        urls = iter(f"sqlite+aiosqlite:///{Path(tmp) / f'usage{i}.db'}" for i in range(2))

        async def next_sqlite() -> str:
            return next(urls)

        result["sqlite"] = asyncio.run(run(next(urls), rows, repeats, next_sqlite))
    if args.pg_url:

        async def wiped_pg() -> str:
            await wipe_pg(args.pg_url)
            return args.pg_url

        asyncio.run(wipe_pg(args.pg_url))
        result["postgresql"] = asyncio.run(run(args.pg_url, rows, repeats, wiped_pg))
        asyncio.run(wipe_pg(args.pg_url))
    print(f"{'query (busy tenant, 30 days)':<30} {'db':<11} {'before ms':>10} {'after ms':>9}")
    for db in ("sqlite", "postgresql"):
        if db in result:
            for name, ms in result[db]["after_ms"].items():
                before = result[db]["before_ms"].get(name, "-")
                print(f"{name:<30} {db:<11} {before:>10} {ms:>9}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
