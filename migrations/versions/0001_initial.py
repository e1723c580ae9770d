"""Initial schema: tenants, api_keys, adapters, usage_events.

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_UTC = sa.DateTime(timezone=True)
_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    """Create every table."""
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("created_at", _UTC, nullable=False),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("max_concurrent_requests", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("created_at", _UTC, nullable=False),
        sa.Column("revoked_at", _UTC, nullable=True),
        sa.Column("last_used_at", _UTC, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name="fk_api_keys_tenant_id_tenants",
            ondelete="CASCADE",
        ),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_index("ix_api_keys_key_hash", "api_keys", ["key_hash"], unique=True)
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("digest", sa.String(128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("lora_alpha", sa.Float(), nullable=False),
        sa.Column("target_modules", sa.JSON(), nullable=False),
        sa.Column("base_model", sa.String(512), nullable=True),
        sa.Column("created_at", _UTC, nullable=False),
        sa.Column("deleted_at", _UTC, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_adapters"),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name="fk_adapters_tenant_id_tenants",
            ondelete="CASCADE",
        ),
    )
    op.create_index("ix_adapters_tenant_id", "adapters", ["tenant_id"])
    op.create_index(
        "uq_adapters_tenant_id_name_live",
        "adapters",
        ["tenant_id", "name"],
        unique=True,
        sqlite_where=sa.text("deleted_at IS NULL"),
        postgresql_where=sa.text("deleted_at IS NULL"),
    )
    op.create_table(
        "usage_events",
        sa.Column("id", _BIG_ID, autoincrement=True, nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("adapter_digest", sa.String(128), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("images", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error_type", sa.String(64), nullable=True),
        sa.Column("created_at", _UTC, nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_usage_events"),
        sa.UniqueConstraint("request_id", name="uq_usage_events_request_id"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_usage_events_tenant_id_tenants"
        ),
        sa.ForeignKeyConstraint(
            ["key_id"], ["api_keys.id"], name="fk_usage_events_key_id_api_keys"
        ),
        sa.CheckConstraint(
            "status IN ('ok', 'error', 'aborted')", name=op.f("ck_usage_events_status")
        ),
    )
    op.create_index(
        "ix_usage_events_tenant_id_created_at", "usage_events", ["tenant_id", "created_at"]
    )


def downgrade() -> None:
    """Drop every table, dependents first."""
    op.drop_index("ix_usage_events_tenant_id_created_at", table_name="usage_events")
    op.drop_table("usage_events")
    op.drop_index("uq_adapters_tenant_id_name_live", table_name="adapters")
    op.drop_index("ix_adapters_tenant_id", table_name="adapters")
    op.drop_table("adapters")
    op.drop_index("ix_api_keys_key_hash", table_name="api_keys")
    op.drop_index("ix_api_keys_tenant_id", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
