"""The console's usage queries: counters and latency percentiles per hour or day, per tenant.

They read the hourly rollups that the database keeps from ``usage_events`` (migration 0006:
``usage_hourly`` and ``usage_hourly_latency``, filled by an ``AFTER INSERT`` trigger in the
row's own transaction), so a month of one tenant is at most 720 rows per model and about 30
latency bins per hour, however many requests it made. Ranges are whole UTC hours: ``since`` is
rounded down and ``until`` up to the hour (the plots are per hour or day anyway).

Latency percentiles (p50, p95, p99 of ``latency_ms``) come from a log-scale histogram: bin
``floor(8 * ln(1 + latency_ms))``, so each bin spans a factor of ``e^(1/8)`` (about 1.13) and a
percentile read at its bin's geometric middle is within about 6.5 % of the exact one (the idea
of HdrHistogram and Prometheus' native histograms: bounded relative error, bounded rows). Rows
without a latency count in the counters, not in the percentiles.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import String, and_, case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.gateway.db.models import Tenant, UsageHourly, UsageHourlyLatency
from loraplex.gateway.db.types import as_utc

BUCKETS = {"hour": timedelta(hours=1), "day": timedelta(days=1)}
_SQLITE_CHARS = {"hour": 13, "day": 10}  # "YYYY-MM-DD HH", "YYYY-MM-DD"
_PG_FORMATS = {"hour": "YYYY-MM-DD HH24", "day": "YYYY-MM-DD"}
_PY_FORMATS = {"hour": "%Y-%m-%d %H", "day": "%Y-%m-%d"}
BINS_PER_E = 8  # histogram bins per factor e of latency
PERCENTILES = (50, 95, 99)
COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "images", "errors")
MAX_RANGE = {"hour": timedelta(days=62), "day": timedelta(days=400)}


@dataclass
class UsageBucket:
    """One time bucket (for one tenant and model, or all of them) and what it used.

    Attributes:
        start: The bucket's first instant (UTC).
        tenant_id: The tenant (None when tenants are added up).
        model: The model or adapter name (None when models are added up).
        counts: ``requests``, ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
            ``images``, ``errors`` (status ``error``) and ``aborted``, integers.
        percentile_bins: For each of :data:`PERCENTILES`, the histogram bin it falls in (the
            first bin whose cumulative count reaches ``q`` % of the bucket's requests).
    """

    start: datetime
    tenant_id: str | None = None
    model: str | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys((*COUNTS, "aborted"), 0))
    percentile_bins: dict[int, int] = field(default_factory=dict)

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile of latency in ms (bin middle, ~6.5 %); None without latencies."""
        b = self.percentile_bins.get(q)
        return None if b is None else math.exp((b + 0.5) / BINS_PER_E) - 1

    def row(self) -> dict[str, Any]:
        """A flat dict: start (ISO), tenant, model, the counts and ``latency_p50_ms``..."""
        out: dict[str, Any] = {"start": self.start.isoformat(), "tenant_id": self.tenant_id}
        out["model"] = self.model
        out.update(self.counts)
        for q in PERCENTILES:
            value = self.percentile(q)
            out[f"latency_p{q}_ms"] = None if value is None else round(value, 1)
        return out


def check_range(bucket: str, since: datetime, until: datetime) -> None:
    """Refuse an unknown bucket or a range too long for it (bounded rows and work).

    Raises:
        ValueError: the message names the problem.
    """
    if bucket not in BUCKETS:
        raise ValueError(f"bucket must be one of {sorted(BUCKETS)}, not {bucket!r}")
    if until <= since:
        raise ValueError("'until' must be after 'since'")
    if until - since > MAX_RANGE[bucket]:
        raise ValueError(f"at most {MAX_RANGE[bucket].days} days per {bucket}")


def hour_bounds(since: datetime, until: datetime) -> tuple[str, str]:
    """``[since, until)`` as rollup hours: ``since`` rounded down, ``until`` up (UTC text)."""
    start = as_utc(since).replace(minute=0, second=0, microsecond=0)
    end = as_utc(until)
    if end != end.replace(minute=0, second=0, microsecond=0):
        end = end.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    return start.strftime(_PY_FORMATS["hour"]), end.strftime(_PY_FORMATS["hour"])


def _when(table: Any, bucket: str) -> Any:
    if bucket == "hour":
        return table.hour.label("bucket")
    return func.substr(table.hour, 1, 10, type_=String).label("bucket")


async def usage_buckets(
    session: AsyncSession,
    *,
    tenant_id: str | None,
    since: datetime,
    until: datetime,
    bucket: str = "hour",
    model: str | None = None,
    split: bool = False,
    max_rows: int | None = None,
) -> list[UsageBucket]:
    """Usage in ``[since, until)`` (whole hours) per ``bucket``, sorted by time, tenant, model.

    Args:
        session: The session.
        tenant_id: Whose rows (None: every tenant's; the console gives None to the admin only).
        since: Start, rounded down to the hour (aware, or naive UTC).
        until: End, rounded up to the hour.
        bucket: ``"hour"`` or ``"day"``.
        model: Only this model or adapter name (None: all).
        split: One bucket per (time, tenant, model) instead of all added up per time.
        max_rows: Refuse (``ValueError``) a result of more buckets than this.

    Returns:
        The buckets that have rows (empty ones are left out; :func:`fill` adds them).

    Raises:
        ValueError: see :func:`check_range`; more than ``max_rows`` buckets.
    """
    since, until = as_utc(since), as_utc(until)
    check_range(bucket, since, until)
    first, last = hour_bounds(since, until)
    out: dict[tuple, UsageBucket] = {}
    starts: dict[str, datetime] = {}  # each bucket's text parsed once

    def item(when_text: str, tenant: str | None, name: str | None) -> UsageBucket:
        start = starts.get(when_text)
        if start is None:
            start = datetime.strptime(when_text, _PY_FORMATS[bucket]).replace(tzinfo=UTC)
            starts[when_text] = start
        found = out.get((start, tenant, name))
        if found is None:
            found = out[(start, tenant, name)] = UsageBucket(start, tenant, name)
        return found

    for table in (UsageHourly, UsageHourlyLatency):
        where = [table.hour >= first, table.hour < last]
        if tenant_id is not None:
            where.insert(0, table.tenant_id == tenant_id)
        if table is UsageHourlyLatency:  # model "" holds every model of the hour
            where.append(table.model == (model or "") if model or not split else table.model != "")
        elif model:
            where.append(table.model == model)
        keys = [_when(table, bucket)] + ([table.tenant_id, table.model] if split else [])
        if table is UsageHourly:
            sums = [func.sum(getattr(table, c)) for c in _ROLLUP_COUNTS]
            query = select(*keys, *sums).where(and_(*where)).group_by(*keys)
            if max_rows is not None:
                query = query.limit(max_rows + 1)
            rows = (await session.execute(query)).all()
            if max_rows is not None and len(rows) > max_rows:
                raise ValueError(f"over {max_rows} rows; narrow the range, tenant or model")
            for row in rows:
                keyed = item(row[0], *(row[1:3] if split else (None, None)))
                for name, value in zip(_ROLLUP_COUNTS, row[len(keys) :], strict=True):
                    keyed.counts[name] += int(value or 0)
        else:
            for row in (await session.execute(_percentile_query(keys, where))).all():
                keyed = item(row[0], *(row[1:3] if split else (None, None)))
                for q, b in zip(PERCENTILES, row[len(keys) :], strict=True):
                    if b is not None:
                        keyed.percentile_bins[q] = int(b)
    return [out[k] for k in sorted(out, key=lambda k: (k[0], k[1] or "", k[2] or ""))]


_ROLLUP_COUNTS = (*COUNTS, "aborted")


def _percentile_query(keys: list, where: list) -> Any:
    """Each bucket's p50/p95/p99 bins, computed in SQL: one row per bucket, not per bin.

    The bins' counts are summed per bucket, then a running sum over the bins in order
    (a window function, SQLite 3.25+ and PostgreSQL) and the bucket's total pick, for each
    percentile, the first bin whose running sum reaches it.
    """
    t = UsageHourlyLatency
    names = [k.name for k in keys]
    per_bin = (
        select(*keys, t.bin.label("bin"), func.sum(t.requests).label("n"))
        .where(and_(*where))
        .group_by(*keys, t.bin)
        .subquery()
    )
    part = [per_bin.c[n] for n in names]
    running = select(
        *part,
        per_bin.c.bin,
        func.sum(per_bin.c.n).over(partition_by=part, order_by=per_bin.c.bin).label("cum"),
        func.sum(per_bin.c.n).over(partition_by=part).label("total"),
    ).subquery()
    cols = [running.c[n] for n in names]
    picks = [
        func.min(case((running.c.cum * 100 >= running.c.total * q, running.c.bin)))
        for q in PERCENTILES
    ]
    return select(*cols, *picks).group_by(*cols)


def fill(buckets: list[UsageBucket], since: datetime, until: datetime, bucket: str) -> list:
    """``buckets`` (added up, not split) with an empty one for every missing time in the range."""
    step = BUCKETS[bucket]
    start = as_utc(since).replace(minute=0, second=0, microsecond=0)
    if bucket == "day":
        start = start.replace(hour=0)
    have = {b.start: b for b in buckets}
    out = []
    while start < as_utc(until):
        out.append(have.get(start) or UsageBucket(start))
        start += step
    return out


async def usage_breakdown(
    session: AsyncSession, *, tenant_id: str | None, since: datetime, until: datetime
) -> list[dict[str, Any]]:
    """Totals per (tenant, model) in ``[since, until)`` (whole hours), heaviest first by tokens.

    Returns:
        ``{"tenant_id", "tenant", "model", "requests", "prompt_tokens", "completion_tokens",
        "cached_tokens", "images", "errors"}`` per pair (``tenant`` is the tenant's name).
    """
    first, last = hour_bounds(since, until)
    t = UsageHourly
    where = [t.hour >= first, t.hour < last]
    if tenant_id is not None:
        where.insert(0, t.tenant_id == tenant_id)
    tokens = func.sum(t.prompt_tokens + t.completion_tokens)
    query = (
        select(t.tenant_id, t.model, *(func.sum(getattr(t, n)).label(n) for n in COUNTS))
        .where(and_(*where))
        .group_by(t.tenant_id, t.model)
        .order_by(tokens.desc(), t.tenant_id, t.model)
    )
    rows = [dict(r) for r in (await session.execute(query)).mappings()]
    ids = {r["tenant_id"] for r in rows}
    tenant_names: dict[str, str] = defaultdict(str)
    if ids:
        found = await session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(ids)))
        tenant_names.update({tid: name for tid, name in found})
    for r in rows:
        r["tenant"] = tenant_names[r["tenant_id"]]
        for name in COUNTS:
            r[name] = int(r[name] or 0)
    return rows
