"""The Batch API: ``files`` and ``batches`` tables, and ``usage_events.batch_id``.

A batch line's usage row names its batch (``batch_id``, nullable: interactive requests have
none). Files' bytes live in the data directory; these tables hold their metadata and each
batch's state, so a restarted gateway resumes its batches.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_UTC = sa.DateTime(timezone=True)
_TIMES = (
    "expires_at",
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def upgrade() -> None:
    """Create ``files`` and ``batches``; add ``usage_events.batch_id`` (batch mode: SQLite)."""
    with op.batch_alter_table("usage_events") as batch:
        batch.add_column(sa.Column("batch_id", sa.String(64), nullable=True))
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(256), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("lines", sa.Integer(), nullable=False),
        sa.Column("created_at", _UTC, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_files_tenant_id_tenants", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_files_tenant_id_created_at", "files", ["tenant_id", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("total", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("completed", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("failed", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", _UTC, nullable=False),
        *(sa.Column(name, _UTC, nullable=True) for name in _TIMES),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_batches_tenant_id_tenants", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_batches_tenant_id_created_at", "batches", ["tenant_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])


def downgrade() -> None:
    """Drop both tables and the column."""
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_index("ix_batches_tenant_id_created_at", table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_files_tenant_id_created_at", table_name="files")
    op.drop_table("files")
    with op.batch_alter_table("usage_events") as batch:
        batch.drop_column("batch_id")
