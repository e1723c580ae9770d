"""stored_responses: Responses API answers kept for retrieval and ``previous_response_id``.

Revision ID: 0003
Revises: 0002
Create Date: 2025-03-01 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_UTC = sa.DateTime(timezone=True)


def upgrade() -> None:
    """Create the table and its (tenant, time) index."""
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("created_at", _UTC, nullable=False),
        sa.Column("expires_at", _UTC, nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("context", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_stored_responses"),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name="fk_stored_responses_tenant_id_tenants",
            ondelete="CASCADE",
        ),
    )
    op.create_index(
        "ix_stored_responses_tenant_id_created_at",
        "stored_responses",
        ["tenant_id", "created_at"],
    )


def downgrade() -> None:
    """Drop the table."""
    op.drop_index("ix_stored_responses_tenant_id_created_at", table_name="stored_responses")
    op.drop_table("stored_responses")
