"""The gateway's tables: tenants, keys, adapters, usage events, stored responses, files, batches.

Every datetime is timezone-aware UTC (``UTCDateTime``). Identifiers are random UUID4 hex strings,
so they can be shown to users and never reveal how many tenants or keys exist. Constraint names
follow ``NAMING_CONVENTION`` so that Alembic's batch mode can find them again on SQLite.

The migrations in ``migrations/versions/`` must create exactly this schema; a test compares the
two with Alembic's ``compare_metadata``.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from loraplex.gateway.db.types import UTCDateTime, utcnow

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

USAGE_STATUSES = ("ok", "error", "aborted")

# A 64-bit key on PostgreSQL; SQLite only auto-increments a column declared INTEGER.
_BIG_ID = BigInteger().with_variant(Integer(), "sqlite")


def new_id() -> str:
    """A fresh random identifier: 32 lowercase hex digits (UUID4)."""
    return uuid.uuid4().hex


class Base(DeclarativeBase):
    """Declarative base holding the shared metadata."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    """A customer. Limits left NULL fall back to the server's defaults (its flags)."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer)

    def __repr__(self) -> str:
        return f"Tenant(id={self.id!r}, name={self.name!r})"


class ApiKey(Base):
    """A tenant's API key. Only the HMAC-SHA-256 of the key is stored, never the key.

    ``prefix`` is the key's first 8 characters (``lpx-abcd``), for display and support; it carries
    24 bits of the key's 256, so it identifies without weakening.
    """

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())

    def __repr__(self) -> str:  # never the hash: it is a credential-equivalent lookup value
        return f"ApiKey(id={self.id!r}, tenant_id={self.tenant_id!r}, prefix={self.prefix!r})"


class Adapter(Base):
    """A tenant's uploaded LoRA adapter, by name; the weights live in the content store.

    Deleting (or replacing) an adapter sets ``deleted_at`` and keeps the row, so history keeps
    the digest a name meant at the time. A name is unique per tenant among live rows only: a
    partial unique index, which both SQLite (3.8+) and PostgreSQL support.
    """

    __tablename__ = "adapters"
    __table_args__ = (
        Index(
            "uq_adapters_tenant_id_name_live",
            "tenant_id",
            "name",
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    digest: Mapped[str] = mapped_column(String(128))
    rank: Mapped[int] = mapped_column(Integer)
    lora_alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[Any] = mapped_column(JSON)
    base_model: Mapped[str | None] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime())

    def __repr__(self) -> str:
        return f"Adapter(tenant_id={self.tenant_id!r}, name={self.name!r}, digest={self.digest!r})"


class UsageEvent(Base):
    """One executed request's usage, appended once per ``request_id``.

    ``request_id`` is the server's own id of the request (the response id), so each executed
    request is billed once and a usage write retried (after a crash or a database outage) is
    not billed twice. ``client_request_id`` is the client's ``X-Request-Id``, recorded as sent
    and never used to merge requests: two requests with the same one are two rows.

    Written for every outcome: ``status`` is ``ok``, ``error`` or ``aborted`` (client gone), and
    the token counts are whatever was processed, partial ones included. ``model`` is the name the
    client asked for (the served base model or the tenant's adapter name); ``adapter_digest`` pins
    which weights that name meant.
    """

    __tablename__ = "usage_events"
    __table_args__ = (
        CheckConstraint("status IN ('ok', 'error', 'aborted')", name="status"),
        # One tenant's time range read from the index alone (the console, /v1/usage): the
        # covering index of migration 0006 (docs/console.md).
        Index(
            "ix_usage_events_console",
            "tenant_id",
            "created_at",
            "model",
            "status",
            "latency_ms",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "images",
        ),
    )

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    model: Mapped[str] = mapped_column(String(256))
    adapter_digest: Mapped[str | None] = mapped_column(String(128))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    images: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    status: Mapped[str] = mapped_column(String(16))
    error_type: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    latency_ms: Mapped[float | None] = mapped_column(Float)
    client_request_id: Mapped[str | None] = mapped_column(String(64))
    batch_id: Mapped[str | None] = mapped_column(String(64))


class UsageHourly(Base):
    """``usage_events`` added up per tenant, UTC hour and model: the console's plots (issue 33).

    Kept by the database itself: an ``AFTER INSERT`` trigger on ``usage_events`` (migration
    0006) adds each new row in the same transaction, so the totals are exact, a row written
    late (a spool replay after an outage) lands in its own hour, and a duplicate that
    ``ON CONFLICT DO NOTHING`` skipped is never counted. ``hour`` is ``YYYY-MM-DD HH`` (UTC).
    ``errors`` and ``aborted`` count the rows of those statuses.
    """

    __tablename__ = "usage_hourly"

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    hour: Mapped[str] = mapped_column(String(13), primary_key=True)
    model: Mapped[str] = mapped_column(String(256), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    images: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    aborted: Mapped[int] = mapped_column(BigInteger)


class UsageHourlyLatency(Base):
    """Requests per tenant, UTC hour, model and latency bin: the console's percentiles.

    Bin ``floor(8 * ln(1 + latency_ms))`` (``gateway.console.usage_queries``); ``model`` ``""``
    holds every model of the hour together. Kept by the same trigger as :class:`UsageHourly`
    (rows with a latency of 0 ms or more only).
    """

    __tablename__ = "usage_hourly_latency"

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    hour: Mapped[str] = mapped_column(String(13), primary_key=True)
    model: Mapped[str] = mapped_column(String(256), primary_key=True)
    bin: Mapped[int] = mapped_column(Integer, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)


class StoredResponse(Base):
    """A Responses API answer kept for ``GET /v1/responses/{id}`` and ``previous_response_id``.

    Written only with ``store: true`` (OpenAI's default), read and deleted only by its tenant
    (``gateway.domains.responses.store``, which also bounds a tenant's rows and bytes).
    ``body`` is the Response object as the client got it, ``context`` the conversation it
    ends (chat messages, the answer last) for a later turn to continue; both JSON text.
    ``size_bytes`` is their UTF-8 length together, what the per-tenant byte budget counts.
    """

    __tablename__ = "stored_responses"
    __table_args__ = (Index("ix_stored_responses_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    size_bytes: Mapped[int] = mapped_column(Integer)
    body: Mapped[str] = mapped_column(Text)
    context: Mapped[str] = mapped_column(Text)

    def __repr__(self) -> str:
        return f"StoredResponse(id={self.id!r}, tenant_id={self.tenant_id!r})"


FILE_PURPOSES = ("batch", "batch_output")
BATCH_STATUSES = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)


class StoredFile(Base):
    """A tenant's file (``/v1/files``): its bytes live in the data directory, not here.

    ``id`` is OpenAI's shape (``file-`` and 32 hex digits). ``purpose`` is ``batch`` (uploaded)
    or ``batch_output`` (a batch's output or error file). ``lines`` is the number of JSONL lines.
    Deleting a file deletes its row and its bytes.
    """

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(256))
    bytes: Mapped[int] = mapped_column(BigInteger)
    lines: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Batch(Base):
    """A tenant's batch (``/v1/batches``): OpenAI's Batch object, one row.

    ``status`` moves ``validating -> in_progress -> finalizing -> completed``, or to ``failed``
    (the input file did not validate: ``errors``), ``cancelling -> cancelled`` or ``expired``;
    each step's time is kept. ``key_id`` is the key that created it: its lines' usage rows
    carry it. The per-line progress lives in the data directory
    (``gateway.domains.batches.progress``), so a restarted gateway resumes where it stopped.
    ``owner`` / ``lease_expires_at``: the gateway running it and until when its claim holds
    (``gateway.domains.batches.lease``; migration 0005).
    """

    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    key_id: Mapped[str | None] = mapped_column(String(32))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    batch_metadata: Mapped[Any] = mapped_column("metadata", JSON, nullable=True)
    errors: Mapped[Any] = mapped_column(JSON, nullable=True)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    total: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    completed: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    failed: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    owner: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
