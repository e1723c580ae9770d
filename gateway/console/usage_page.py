"""``/console/usage`` (plots and a table) and ``/console/usage.csv`` (the same data as CSV)."""

from __future__ import annotations

import csv
import io
import time
import weakref
from datetime import UTC, datetime, timedelta
from typing import Any

from litestar import Response, get
from litestar.params import FromQuery
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.gateway.console.access import ConsoleError, scope_tenant
from loraplex.gateway.console.login import CONSOLE
from loraplex.gateway.console.sessions import ConsoleSession
from loraplex.gateway.console.usage_queries import (
    COUNTS,
    PERCENTILES,
    check_range,
    fill,
    usage_breakdown,
    usage_buckets,
)
from loraplex.gateway.console.views import SECURITY_HEADERS, page
from loraplex.gateway.db.models import Tenant
from loraplex.gateway.db.types import utcnow
from loraplex.gateway.di import Injected
from loraplex.gateway.services.errors import InvalidInputError
from loraplex.gateway.usage.records import parse_time
from loraplex.gateway.usage.writer import UsageWriter

DEFAULT_SPAN = {"hour": timedelta(days=2), "day": timedelta(days=30)}
MAX_MODEL_CHARS = 256  # usage_events.model's length
MAX_CSV_ROWS = 100_000  # lines of one CSV export (time x tenant x model), memory bound
# Instants a query may name: far enough from datetime's ends that the default span, the
# rounding to whole hours and days and the buckets never overflow (an OverflowError, a 500).
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9000, 1, 1, tzinfo=UTC)


FLUSH_INTERVAL_S = 5.0
"""The usage page asks the usage writer to flush what it holds at most this often (per
writer): a tenant reloading the page in a loop must not defeat the writer's batching for
every other tenant (each flush is a database transaction)."""

_last_flush: weakref.WeakKeyDictionary[UsageWriter, float] = weakref.WeakKeyDictionary()


async def _flush_now_and_then(usage: UsageWriter) -> None:
    """Flush the usage writer, unless this page did less than ``FLUSH_INTERVAL_S`` ago."""
    now = time.monotonic()
    if now - _last_flush.get(usage, float("-inf")) < FLUSH_INTERVAL_S:
        return
    _last_flush[usage] = now
    await usage.flush(timeout=2.0)


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""First characters a spreadsheet may read as a formula (OWASP's CSV injection list)."""


def safe_cell(value: Any) -> Any:
    """A client's string as a CSV cell no spreadsheet reads as a formula (a leading ``'``)."""
    if isinstance(value, str) and value[:1] in FORMULA_STARTS:
        return "'" + value
    return value


def _range(bucket: str, since: str | None, until: str | None) -> tuple[datetime, datetime]:
    """The query's ``[since, until)``; by default the last 2 days per hour, 30 per day.

    Raises:
        ConsoleError: 400 naming the bad field.
    """
    bounds: dict[str, datetime | None] = {}
    for name, value in (("since", since), ("until", until)):
        try:
            bounds[name] = parse_time(value)
        except InvalidInputError as exc:
            raise ConsoleError(400, f"'{name}': {exc}") from None
        if bounds[name] is not None and not EARLIEST <= bounds[name] < LATEST:
            raise ConsoleError(400, f"'{name}': must lie in {EARLIEST.year}..{LATEST.year - 1}")
    if bucket not in DEFAULT_SPAN:
        raise ConsoleError(400, f"'bucket' must be 'hour' or 'day', not {bucket[:20]!r}")
    end = bounds["until"] or utcnow()
    start = bounds["since"] or end - DEFAULT_SPAN[bucket]
    try:
        check_range(bucket, start, end)
    except ValueError as exc:
        raise ConsoleError(400, f"'since'/'until': {exc}") from None
    return start, end


async def _query(
    console: ConsoleSession,
    sessions: async_sessionmaker,
    usage: UsageWriter,
    tenant: str | None,
    model: str | None,
    bucket: str,
    since: str | None,
    until: str | None,
    *,
    split: bool,
) -> tuple[str | None, datetime, datetime, list, list[dict[str, Any]], list]:
    tenant_id = scope_tenant(console, tenant)
    if model is not None and len(model) > MAX_MODEL_CHARS:
        raise ConsoleError(400, f"'model' is over {MAX_MODEL_CHARS} characters")
    for name, value in (("tenant", tenant), ("model", model)):
        if value is not None and "\x00" in value:  # PostgreSQL refuses NUL in text
            raise ConsoleError(400, f"'{name}' holds a NUL character")
    start, end = _range(bucket, since, until)
    await _flush_now_and_then(usage)  # what the writer holds is shown too (best effort)
    async with sessions() as db:
        try:
            buckets = await usage_buckets(
                db,
                tenant_id=tenant_id,
                since=start,
                until=end,
                bucket=bucket,
                model=model or None,
                split=split,
                max_rows=MAX_CSV_ROWS if split else None,
            )
        except ValueError as exc:
            raise ConsoleError(400, f"'since'/'until': {exc}") from None
        breakdown = (
            [] if split else await usage_breakdown(db, tenant_id=tenant_id, since=start, until=end)
        )
        tenants = []
        if console.admin:
            tenants = list(await db.execute(select(Tenant.id, Tenant.name).order_by(Tenant.name)))
    return tenant_id, start, end, buckets, breakdown, tenants


@get("/usage", opt=CONSOLE)
async def usage_page(
    console: Injected[ConsoleSession],
    sessions: Injected[async_sessionmaker],
    usage: Injected[UsageWriter],
    tenant: FromQuery[str | None] = None,
    model: FromQuery[str | None] = None,
    bucket: FromQuery[str] = "hour",
    since: FromQuery[str | None] = None,
    until: FromQuery[str | None] = None,
) -> Response:
    """Requests, tokens, images, errors and latency percentiles over time, with plots.

    ``tenant`` (the admin's choice; a tenant's own or 403), ``model`` (a model or adapter name),
    ``bucket`` (``hour`` or ``day``), ``since``/``until`` (ISO 8601, UTC when naive).
    """
    tenant_id, start, end, buckets, breakdown, tenants = await _query(
        console, sessions, usage, tenant, model, bucket, since, until, split=False
    )
    series = fill(buckets, start, end, bucket)
    plot = {
        "t": [int(b.start.timestamp()) for b in series],
        **{name: [b.counts[name] for b in series] for name in COUNTS},
        **{f"p{q}": [b.percentile(q) for b in series] for q in PERCENTILES},
    }
    totals = {name: sum(plot[name]) for name in COUNTS}
    return page(
        "usage.html",
        console,
        plot=plot,
        totals=totals,
        breakdown=breakdown,
        tenants=tenants,
        filters={
            "tenant": tenant_id or "",
            "model": model or "",
            "bucket": bucket,
            "since": start.isoformat(timespec="minutes"),
            "until": end.isoformat(timespec="minutes"),
        },
    )


@get("/usage.csv", opt=CONSOLE)
async def usage_csv(
    console: Injected[ConsoleSession],
    sessions: Injected[async_sessionmaker],
    usage: Injected[UsageWriter],
    tenant: FromQuery[str | None] = None,
    model: FromQuery[str | None] = None,
    bucket: FromQuery[str] = "hour",
    since: FromQuery[str | None] = None,
    until: FromQuery[str | None] = None,
) -> Response:
    """The usage page's data per (time, tenant, model) as CSV (``text/csv`` attachment)."""
    _, _, _, buckets, _, _ = await _query(
        console, sessions, usage, tenant, model, bucket, since, until, split=True
    )
    out = io.StringIO()
    rows = [b.row() for b in buckets]
    columns = list(rows[0]) if rows else ["start", "tenant_id", "model"]
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        # a model name is a client's string: never let a spreadsheet read it as a formula
        row["model"] = safe_cell(row["model"])
        writer.writerow(row)
    return Response(
        out.getvalue(),
        media_type="text/csv; charset=utf-8",
        headers={**SECURITY_HEADERS, "Content-Disposition": 'attachment; filename="usage.csv"'},
    )
