"""replicas, session stop reasons, an index of open calls

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 06:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Spelled out rather than imported: a migration must keep meaning what it meant when written.
OPEN_CALL_SQL = (
    "status IN ('pending', 'running', 'unknown', 'succeeded', 'failed') "
    "OR (status = 'submitted' AND confirmed_at IS NULL)"
)


def upgrade() -> None:
    op.create_table(
        "replicas",
        sa.Column("replica_id", sa.String(length=255), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("replica_id", name=op.f("pk_replicas")),
    )
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("reason", sa.Text(), nullable=True))
        batch.create_index("ix_sessions_owner", ["owner"], unique=False)
    op.create_index(
        "ix_tool_calls_open",
        "tool_calls",
        ["session_id"],
        unique=False,
        postgresql_where=sa.text(OPEN_CALL_SQL),
        sqlite_where=sa.text(OPEN_CALL_SQL),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_tool_calls_open",
        table_name="tool_calls",
        postgresql_where=sa.text(OPEN_CALL_SQL),
        sqlite_where=sa.text(OPEN_CALL_SQL),
    )
    with op.batch_alter_table("sessions") as batch:
        batch.drop_index("ix_sessions_owner")
        batch.drop_column("reason")
    op.drop_table("replicas")
