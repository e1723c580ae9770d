"""Batch owner leases: ``batches.owner`` and ``batches.lease_expires_at``.

Several gateways on one database each run the batch runner; a gateway runs a batch only while
it holds the batch's lease (claimed with a conditional UPDATE, renewed while it runs), and
takes over only batches whose lease has expired (``gateway.domains.batches.lease``).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the two nullable columns (batch mode: SQLite)."""
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("owner", sa.String(64), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("lease_expires_at")
        batch.drop_column("owner")
