"""The console's usage queries: counters and latency percentiles per hour or day, from the ledger.

One ``GROUP BY`` over ``usage_events`` per view, read through the index
``ix_usage_events_console`` (``tenant_id, created_at`` and the summed columns: migration 0005),
so a tenant's month is read from the index alone. The time bucket is computed in SQL: on SQLite
the first 13 (hour) or 10 (day) characters of the stored ISO time (``gateway.db.types``: UTC,
fixed width), on PostgreSQL ``to_char`` of the UTC time.

Latency percentiles (p50, p95, p99 of ``latency_ms``) come from a log-scale histogram counted
in the same statement: bin ``floor(8 * ln(1 + latency_ms))``, so each bin spans a factor of
``e^(1/8)`` (about 1.13) and a percentile read at its bin's geometric middle is within about
6.5 % of the exact one (the idea of HdrHistogram and Prometheus' native histograms: bounded
relative error, bounded rows). Rows without a latency count in the counters, not in the
percentiles. Both databases need ``ln`` (SQLite 3.35+ built with its math functions, as
CPython's and Debian's are).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Integer, String, and_, case, cast, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.gateway.db.models import Tenant, UsageEvent
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
        latency_bins: Requests by histogram bin of ``latency_ms`` (see the module docstring).
    """

    start: datetime
    tenant_id: str | None = None
    model: str | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys((*COUNTS, "aborted"), 0))
    latency_bins: dict[int, int] = field(default_factory=dict)

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile of latency in ms (bin middle, ~6.5 %); None without latencies."""
        total = sum(self.latency_bins.values())
        if not total:
            return None
        rank = q / 100 * total
        seen = 0
        for b in sorted(self.latency_bins):
            seen += self.latency_bins[b]
            if seen >= rank:
                return math.exp((b + 0.5) / BINS_PER_E) - 1
        return None  # unreachable: seen ends at total >= rank

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


def _bucket_column(dialect: str, bucket: str) -> Any:
    if dialect == "postgresql":
        utc = func.timezone("UTC", UsageEvent.created_at)
        return func.to_char(utc, _PG_FORMATS[bucket], type_=String)
    return func.substr(cast(UsageEvent.created_at, String), 1, _SQLITE_CHARS[bucket], type_=String)


async def usage_buckets(
    session: AsyncSession,
    *,
    tenant_id: str | None,
    since: datetime,
    until: datetime,
    bucket: str = "hour",
    model: str | None = None,
    split: bool = False,
) -> list[UsageBucket]:
    """Usage in ``[since, until)`` per ``bucket``, sorted by time (then tenant and model).

    Args:
        session: The session.
        tenant_id: Whose rows (None: every tenant's; the console gives None to the admin only).
        since: Inclusive start (aware, or naive UTC).
        until: Exclusive end.
        bucket: ``"hour"`` or ``"day"``.
        model: Only this model or adapter name (None: all).
        split: One bucket per (time, tenant, model) instead of all added up per time.

    Returns:
        The buckets that have rows (empty ones are left out; :func:`fill` adds them).

    Raises:
        ValueError: see :func:`check_range`.
    """
    since, until = as_utc(since), as_utc(until)
    check_range(bucket, since, until)
    dialect = session.get_bind().dialect.name
    when = _bucket_column(dialect, bucket).label("bucket")
    scaled = func.ln(UsageEvent.latency_ms + 1.0) * BINS_PER_E  # >= 0: latencies are >= 0
    # SQLite's CAST truncates (the floor of a non-negative number); PostgreSQL's rounds. Not
    # SQLite's floor(): SQLAlchemy replaces it with a Python function called per row.
    latency_bin = cast(scaled if dialect == "sqlite" else func.floor(scaled), Integer).label("bin")
    where = [UsageEvent.created_at >= since, UsageEvent.created_at < until]
    if tenant_id is not None:
        where.insert(0, UsageEvent.tenant_id == tenant_id)
    if model is not None:
        where.append(UsageEvent.model == model)
    keys = [when, latency_bin] + ([UsageEvent.tenant_id, UsageEvent.model] if split else [])
    status = UsageEvent.status
    query = (
        select(
            *keys,
            func.count().label("requests"),
            func.sum(UsageEvent.prompt_tokens).label("prompt_tokens"),
            func.sum(UsageEvent.completion_tokens).label("completion_tokens"),
            func.sum(UsageEvent.cached_tokens).label("cached_tokens"),
            func.sum(UsageEvent.images).label("images"),
            func.sum(case((status == "error", 1), else_=0)).label("errors"),
            func.sum(case((status == "aborted", 1), else_=0)).label("aborted"),
        )
        .where(and_(*where))
        .group_by(*keys)
    )
    out: dict[tuple, UsageBucket] = {}
    for row in (await session.execute(query)).mappings():
        start = datetime.strptime(row["bucket"], _PY_FORMATS[bucket]).replace(tzinfo=UTC)
        tenant = row["tenant_id"] if split else None
        name = row["model"] if split else None
        item = out.get((start, tenant, name))
        if item is None:
            item = out[(start, tenant, name)] = UsageBucket(start, tenant, name)
        for counter in item.counts:
            item.counts[counter] += int(row[counter] or 0)
        if row["bin"] is not None:
            item.latency_bins[row["bin"]] = item.latency_bins.get(row["bin"], 0) + row["requests"]
    return [out[k] for k in sorted(out, key=lambda k: (k[0], k[1] or "", k[2] or ""))]


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
    """Totals per (tenant, model) in ``[since, until)``, heaviest first by tokens.

    Returns:
        ``{"tenant_id", "tenant", "model", "requests", "prompt_tokens", "completion_tokens",
        "cached_tokens", "images", "errors"}`` per pair (``tenant`` is the tenant's name).
    """
    where = [UsageEvent.created_at >= as_utc(since), UsageEvent.created_at < as_utc(until)]
    if tenant_id is not None:
        where.insert(0, UsageEvent.tenant_id == tenant_id)
    tokens = func.sum(UsageEvent.prompt_tokens + UsageEvent.completion_tokens)
    query = (
        select(
            UsageEvent.tenant_id,
            UsageEvent.model,
            func.count().label("requests"),
            func.sum(UsageEvent.prompt_tokens).label("prompt_tokens"),
            func.sum(UsageEvent.completion_tokens).label("completion_tokens"),
            func.sum(UsageEvent.cached_tokens).label("cached_tokens"),
            func.sum(UsageEvent.images).label("images"),
            func.sum(case((UsageEvent.status == "error", 1), else_=0)).label("errors"),
        )
        .where(and_(*where))
        .group_by(UsageEvent.tenant_id, UsageEvent.model)
        .order_by(tokens.desc(), UsageEvent.tenant_id, UsageEvent.model)
    )
    rows = [dict(r) for r in (await session.execute(query)).mappings()]
    ids = {r["tenant_id"] for r in rows}
    names: dict[str, str] = defaultdict(str)
    if ids:
        found = await session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(ids)))
        names.update({tid: name for tid, name in found})
    for r in rows:
        r["tenant"] = names[r["tenant_id"]]
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "images", "errors"):
            r[name] = int(r[name] or 0)
    return rows
