"""usage_events.client_request_id: the client's X-Request-Id, no longer part of the row's key.

Until this revision a request with ``X-Request-Id: R`` was keyed ``<tenant id>:R``, so different
requests reusing one id were billed once. From now on ``request_id`` is always the server's id
and the client's id is kept here, nullable and not unique. Rows keyed the old way get their
client id copied out (the part after ``<tenant id>:``); their ``request_id`` stays, so a replay
of an old write is still deduplicated.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the column (batch mode: SQLite) and fill it for rows keyed by the client's id."""
    with op.batch_alter_table("usage_events") as batch:
        batch.add_column(sa.Column("client_request_id", sa.String(64), nullable=True))
    op.execute(
        "UPDATE usage_events SET client_request_id = "
        "substr(request_id, length(tenant_id) + 2) "
        "WHERE substr(request_id, 1, length(tenant_id) + 1) = tenant_id || ':' "
        "AND length(request_id) - length(tenant_id) - 1 BETWEEN 1 AND 64"
    )


def downgrade() -> None:
    """Drop the column."""
    with op.batch_alter_table("usage_events") as batch:
        batch.drop_column("client_request_id")
