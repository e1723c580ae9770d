"""The console's usage reads (issue 33): hourly rollups kept by a trigger, and a covering index.

* ``usage_hourly`` (per tenant, UTC hour, model: requests, the four counters, errors, aborted)
  and ``usage_hourly_latency`` (per tenant, hour, model and latency bin; model ``""`` for all
  of them), filled from the rows already there, then kept by an ``AFTER INSERT`` trigger on
  ``usage_events``: exact (the same transaction as the row), a row written late lands in its own
  hour, a duplicate skipped by ``ON CONFLICT DO NOTHING`` fires nothing. A month of a busy
  tenant is then at most 720 rows per model and ~30 bins per hour to read, whatever its
  request count. The console reads these (``gateway.console.usage_queries``).
* ``ix_usage_events_console`` keys ``usage_events`` by ``tenant_id, created_at`` (what
  ``ix_usage_events_tenant_id_created_at`` did, so that one is dropped) and carries the columns
  ``GET /v1/usage`` and the console's exact-range reads sum (``model``, ``status``,
  ``latency_ms``, the four counters): they read the index alone, never the table's wider rows.

``bench.console_usage`` measures both. The latency bin needs ``ln``: PostgreSQL has it; SQLite
has it when built with its math functions (3.35+, as CPython's and Debian's are), which this
migration checks before it creates a trigger that would otherwise fail every usage write.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

INDEX_COLUMNS = [
    "tenant_id",
    "created_at",
    "model",
    "status",
    "latency_ms",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "images",
]
COUNTERS = ("prompt_tokens", "completion_tokens", "cached_tokens", "images")
BINS_PER_E = 8  # gateway.console.usage_queries.BINS_PER_E
_COLUMNS = f"tenant_id, hour, model, requests, {', '.join(COUNTERS)}, errors, aborted"

_SQLITE_TRIGGER = f"""
CREATE TRIGGER usage_events_rollup AFTER INSERT ON usage_events
BEGIN
  INSERT INTO usage_hourly ({_COLUMNS})
  VALUES (NEW.tenant_id, substr(NEW.created_at, 1, 13), NEW.model, 1,
          {", ".join(f"NEW.{c}" for c in COUNTERS)},
          NEW.status = 'error', NEW.status = 'aborted')
  ON CONFLICT (tenant_id, hour, model) DO UPDATE SET requests = requests + 1,
    {", ".join(f"{c} = {c} + excluded.{c}" for c in COUNTERS)},
    errors = errors + excluded.errors, aborted = aborted + excluded.aborted;
  INSERT INTO usage_hourly_latency (tenant_id, hour, model, bin, requests)
  SELECT NEW.tenant_id, substr(NEW.created_at, 1, 13), m.model,
         CAST(ln(NEW.latency_ms + 1.0) * {BINS_PER_E} AS INTEGER), 1
  FROM (SELECT NEW.model AS model UNION ALL SELECT '') AS m
  WHERE NEW.latency_ms IS NOT NULL AND NEW.latency_ms >= 0
  ON CONFLICT (tenant_id, hour, model, bin) DO UPDATE SET requests = requests + 1;
END
"""

_PG_HOUR = "to_char(NEW.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24')"
_PG_FUNCTION = f"""
CREATE OR REPLACE FUNCTION usage_events_rollup() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO usage_hourly ({_COLUMNS})
  VALUES (NEW.tenant_id, {_PG_HOUR}, NEW.model, 1,
          {", ".join(f"NEW.{c}" for c in COUNTERS)},
          (NEW.status = 'error')::int, (NEW.status = 'aborted')::int)
  ON CONFLICT (tenant_id, hour, model) DO UPDATE SET requests = usage_hourly.requests + 1,
    {", ".join(f"{c} = usage_hourly.{c} + excluded.{c}" for c in COUNTERS)},
    errors = usage_hourly.errors + excluded.errors,
    aborted = usage_hourly.aborted + excluded.aborted;
  IF NEW.latency_ms IS NOT NULL AND NEW.latency_ms >= 0 THEN
    INSERT INTO usage_hourly_latency (tenant_id, hour, model, bin, requests)
    SELECT NEW.tenant_id, {_PG_HOUR}, m, floor(ln(NEW.latency_ms + 1.0) * {BINS_PER_E})::int, 1
    FROM unnest(ARRAY[NEW.model::text, '']) AS m
    ON CONFLICT (tenant_id, hour, model, bin)
    DO UPDATE SET requests = usage_hourly_latency.requests + 1;
  END IF;
  RETURN NULL;
END
$$
"""
_PG_TRIGGER = (
    "CREATE TRIGGER usage_events_rollup AFTER INSERT ON usage_events "
    "FOR EACH ROW EXECUTE FUNCTION usage_events_rollup()"
)


def _backfill(hour: str, latency_bin: str) -> None:
    sums = ", ".join(f"SUM({c})" for c in COUNTERS)
    op.execute(
        f"INSERT INTO usage_hourly ({_COLUMNS}) SELECT tenant_id, {hour}, model, COUNT(*), {sums}, "
        "SUM(CASE WHEN status = 'error' THEN 1 ELSE 0 END), "
        "SUM(CASE WHEN status = 'aborted' THEN 1 ELSE 0 END) "
        "FROM usage_events GROUP BY 1, 2, 3"
    )
    for model in ("model", "''"):
        op.execute(
            "INSERT INTO usage_hourly_latency (tenant_id, hour, model, bin, requests) "
            f"SELECT tenant_id, {hour}, {model}, {latency_bin}, COUNT(*) FROM usage_events "
            "WHERE latency_ms IS NOT NULL AND latency_ms >= 0 "
            "GROUP BY 1, 2, 3, 4"  # by position: PostgreSQL refuses a constant ('') by value
        )


def upgrade() -> None:
    """The covering index (replacing the narrower one), the rollups, their backfill, trigger."""
    op.create_index("ix_usage_events_console", "usage_events", INDEX_COLUMNS)
    op.drop_index("ix_usage_events_tenant_id_created_at", table_name="usage_events")

    def key() -> list[sa.Column]:
        return [
            sa.Column("tenant_id", sa.String(32), nullable=False),
            sa.Column("hour", sa.String(13), nullable=False),
            sa.Column("model", sa.String(256), nullable=False),
        ]

    counts = ["requests", *COUNTERS, "errors", "aborted"]
    op.create_table(
        "usage_hourly",
        *key(),
        *(sa.Column(c, sa.BigInteger(), nullable=False) for c in counts),
        sa.PrimaryKeyConstraint("tenant_id", "hour", "model", name="pk_usage_hourly"),
    )
    op.create_table(
        "usage_hourly_latency",
        *key(),
        sa.Column("bin", sa.Integer(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(
            "tenant_id", "hour", "model", "bin", name="pk_usage_hourly_latency"
        ),
    )
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        _backfill(
            "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24')",
            f"floor(ln(latency_ms + 1.0) * {BINS_PER_E})::int",
        )
        op.execute(_PG_FUNCTION)
        op.execute(_PG_TRIGGER)
    else:
        try:
            op.get_bind().exec_driver_sql("SELECT ln(2.0)")
        except Exception as exc:  # noqa: BLE001 - any refusal: say what is missing
            raise RuntimeError(
                "this SQLite has no math functions (ln); the usage rollup trigger needs "
                "SQLite 3.35+ built with them (CPython's and Debian's are)"
            ) from exc
        _backfill(
            "substr(created_at, 1, 13)", f"CAST(ln(latency_ms + 1.0) * {BINS_PER_E} AS INTEGER)"
        )
        op.execute(_SQLITE_TRIGGER)


def downgrade() -> None:
    """Drop the trigger, the rollups and the covering index; put the narrower index back."""
    op.execute(
        "DROP TRIGGER IF EXISTS usage_events_rollup"
        + (" ON usage_events" if op.get_bind().dialect.name == "postgresql" else "")
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS usage_events_rollup()")
    op.drop_table("usage_hourly_latency")
    op.drop_table("usage_hourly")
    op.create_index(
        "ix_usage_events_tenant_id_created_at", "usage_events", ["tenant_id", "created_at"]
    )
    op.drop_index("ix_usage_events_console", table_name="usage_events")
