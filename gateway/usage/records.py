"""Usage: one append-only event per request, and the ``GET /v1/usage`` aggregate.

An event is keyed by its ``request_id``, an id the server makes for each executed request (the
chat response id), never one a client sends: recording the same id again (a usage write
retried after a crash or an outage, a finaliser running twice) is a no-op, done atomically by
the database with ``INSERT ... ON CONFLICT (request_id) DO NOTHING`` on SQLite and PostgreSQL
alike, while two different requests always get two rows. The client's ``X-Request-Id`` is kept
in ``client_request_id``, for the client's own reconciliation only.

Every string is made storable before it is written (:meth:`UsageRecord.safe`): PostgreSQL
refuses a NUL character and a lone UTF-16 surrogate in any text column, and a string longer
than its ``VARCHAR``; one such row must never fail the batch it travels in.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import String, Table, cast, func, literal_column, null, select, union_all
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.gateway.db.models import USAGE_STATUSES, UsageEvent
from loraplex.gateway.db.types import as_utc, utcnow
from loraplex.gateway.services.errors import InvalidInputError
from loraplex.gateway.services.keys import touch_key

COUNTERS = ("prompt_tokens", "completion_tokens", "cached_tokens", "images")
MAX_INT32 = 2**31 - 1  # the counters are INTEGER columns
_ON_CONFLICT_INSERTS = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}


@dataclass(frozen=True)
class UsageRecord:
    """What one request used. Token counts are partial for failed and aborted requests.

    ``request_id`` is the server's id of the executed request (unique per row);
    ``client_request_id`` the client's ``X-Request-Id``, if it sent one (not unique);
    ``batch_id`` the batch a line of ``/v1/batches`` belongs to (None for interactive requests).
    ``model`` is the name the client asked for: the served base model or an adapter's name.
    ``created_at`` defaults to the time of recording.
    """

    request_id: str
    tenant_id: str
    model: str
    key_id: str | None = None
    adapter_digest: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    images: int = 0
    status: str = "ok"
    error_type: str | None = None
    ttft_ms: float | None = None
    latency_ms: float | None = None
    created_at: datetime | None = None
    client_request_id: str | None = None
    batch_id: str | None = None

    def safe(self) -> UsageRecord:
        """This record with every value storable in its column, on SQLite and PostgreSQL.

        Strings: a NUL becomes U+FFFD, a lone surrogate ``?`` (both refused by PostgreSQL's
        text types; the surrogate by any UTF-8 encoder), and the result is cut to the column's
        length in characters. Counters are clamped to ``[0, 2**31 - 1]``; a NaN or infinite
        time becomes None. Returns ``self`` when nothing needs changing (the usual case).
        """
        changes: dict[str, Any] = {}
        for name, limit in _STRING_LIMITS:
            value = getattr(self, name)
            if value is not None:
                fixed = storable_text(value, limit)
                if fixed is not value:
                    changes[name] = fixed
        for name in COUNTERS:
            value = getattr(self, name)
            if type(value) is int and value > MAX_INT32:
                changes[name] = MAX_INT32
        for name in ("ttft_ms", "latency_ms"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                changes[name] = None
        return dataclasses.replace(self, **changes) if changes else self

    def validate(self) -> None:
        """Raise ``InvalidInputError`` on an unknown status, a negative count or no id."""
        if not self.request_id or not self.tenant_id or not self.model:
            raise InvalidInputError("request_id, tenant_id and model are required")
        if self.status not in USAGE_STATUSES:
            raise InvalidInputError(f"status must be one of {USAGE_STATUSES}, not {self.status!r}")
        for name in COUNTERS:
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise InvalidInputError(f"{name} must be a non-negative integer")


def storable_text(value: str, limit: int | None) -> str:
    """``value`` with NUL and lone surrogates replaced and cut to ``limit`` characters.

    Returns ``value`` itself (the same object) when it is already storable.
    """
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (JSON allows "\\ud800")
            value = value.encode("utf-8", "replace").decode("utf-8")
    if "\x00" in value:
        value = value.replace("\x00", "\ufffd")
    if limit is not None and len(value) > limit:
        value = value[:limit]
    return value


_STRING_LIMITS = tuple(
    (column.name, getattr(column.type, "length", None))
    for column in UsageEvent.__table__.columns
    if column.name in {f.name for f in dataclasses.fields(UsageRecord)}
    and isinstance(column.type, String)
)


async def record_usage(
    session: AsyncSession, record: UsageRecord | None = None, /, **fields: Any
) -> bool:
    """Append a usage event unless one with the same ``request_id`` exists.

    Pass a ``UsageRecord`` or its fields as keywords. Also stamps the key's ``last_used_at``
    (at most once a minute, see ``touch_key``). Flushes in the caller's transaction.

    Returns:
        True if the event was inserted, False if the request id was already recorded.
    """
    if record is None:
        record = UsageRecord(**fields)
    elif fields:
        record = dataclasses.replace(record, **fields)
    record = record.safe()
    record.validate()
    values = dataclasses.asdict(record)
    values["created_at"] = as_utc(record.created_at or utcnow())
    table: Table = UsageEvent.__table__
    dialect = session.get_bind().dialect.name
    make_insert = _ON_CONFLICT_INSERTS.get(dialect)
    if make_insert is not None:
        stmt = (
            make_insert(table)
            .values(**values)
            .on_conflict_do_nothing(index_elements=["request_id"])
        )
        inserted = (await session.execute(stmt)).rowcount == 1
    else:  # another backend: a savepoint, and "exists" means the unique constraint fired
        inserted = await _insert_with_savepoint(session, table, values)
    if inserted and record.key_id is not None:
        await touch_key(session, record.key_id, now=values["created_at"])
    return inserted


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(UsageRecord))


async def record_usage_batch(session: AsyncSession, records: list[UsageRecord]) -> int:
    """Append many usage events in one statement; request ids already recorded are skipped.

    One multi-row ``INSERT ... ON CONFLICT (request_id) DO NOTHING`` (SQLite, PostgreSQL), then
    one ``touch_key`` per distinct key, in the caller's transaction: the usage writer's path,
    so a flush costs a few statements however many requests it carries. Other backends fall
    back to :func:`record_usage` per event.

    Every record is made storable first (:meth:`UsageRecord.safe`).

    Returns:
        How many events the statement was given (duplicates included; they are no-ops).

    Raises:
        InvalidInputError: a record is malformed (nothing is written).
    """
    if not records:
        return 0
    records = [record.safe() for record in records]
    for record in records:
        record.validate()
    dialect = session.get_bind().dialect.name
    make_insert = _ON_CONFLICT_INSERTS.get(dialect)
    if make_insert is None:
        for record in records:
            await record_usage(session, record)
        return len(records)
    now = utcnow()
    rows = []
    last_use: dict[str, datetime] = {}
    for record in records:
        values = {name: getattr(record, name) for name in _RECORD_FIELDS}  # flat: no deep copy
        values["created_at"] = as_utc(record.created_at or now)
        rows.append(values)
        if record.key_id is not None:
            seen = last_use.get(record.key_id)
            last_use[record.key_id] = (
                max(seen, values["created_at"]) if seen else values["created_at"]
            )
    table: Table = UsageEvent.__table__
    stmt = make_insert(table).on_conflict_do_nothing(index_elements=["request_id"])
    await session.execute(stmt, rows)
    for key_id, when in last_use.items():
        await touch_key(session, key_id, now=when)
    return len(rows)


async def _insert_with_savepoint(session: AsyncSession, table: Table, values: dict) -> bool:
    exists = await session.scalar(
        select(func.count()).select_from(table).where(table.c.request_id == values["request_id"])
    )
    if exists:
        return False
    try:
        async with session.begin_nested():
            await session.execute(table.insert().values(**values))
    except IntegrityError:
        return False
    return True


def parse_time(value: str | None) -> datetime | None:
    """An ISO 8601 query parameter (``?since=``) as an aware UTC datetime; naive means UTC.

    Raises:
        InvalidInputError: not ISO 8601.
    """
    if value is None or value == "":
        return None
    try:
        return as_utc(datetime.fromisoformat(value))
    except ValueError:
        raise InvalidInputError(f"not an ISO 8601 date or time: {value!r}") from None


async def usage_summary(
    session: AsyncSession,
    tenant_id: str,
    since: datetime | None = None,
    until: datetime | None = None,
) -> dict[str, Any]:
    """The tenant's usage in ``[since, until)``, in the ``GET /v1/usage`` shape.

    ``tenant`` is the tenant's id (stable, unlike a name, and what the admin API returns).
    Every recorded request counts, whatever its status. One SQL statement computes the totals
    and the per-model rows (``UNION ALL`` of the grouped and the ungrouped aggregate), so both
    come from the same snapshot and always agree. ``by_model`` is sorted by model name.

    Args:
        session: The session.
        tenant_id: Whose usage; nobody else's rows are ever read.
        since: Inclusive lower bound on ``created_at``; naive means UTC.
        until: Exclusive upper bound on ``created_at``; naive means UTC.
    """
    where = [UsageEvent.tenant_id == tenant_id]
    if since is not None:
        where.append(UsageEvent.created_at >= as_utc(since))
    if until is not None:
        where.append(UsageEvent.created_at < as_utc(until))
    sums = [func.count().label("requests")] + [
        func.coalesce(func.sum(getattr(UsageEvent, name)), 0).label(name) for name in COUNTERS
    ]
    per_model = (
        select(literal_column("0").label("is_total"), UsageEvent.model.label("model"), *sums)
        .where(*where)
        .group_by(UsageEvent.model)
    )
    total = select(literal_column("1"), cast(null(), String), *sums).where(*where)
    query = union_all(per_model, total).order_by("is_total", "model")
    rows = (await session.execute(query)).mappings().all()
    fields = ("requests", *COUNTERS)
    totals = next(row for row in rows if row["is_total"] == 1)
    return {
        "object": "usage",
        "tenant": tenant_id,
        "totals": {name: int(totals[name]) for name in fields},
        "by_model": [
            {"model": row["model"], **{name: int(row[name]) for name in fields}}
            for row in rows
            if row["is_total"] == 0
        ],
    }
