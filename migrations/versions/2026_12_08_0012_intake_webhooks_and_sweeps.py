"""intake: sessions served without registration (webhooks, agent sweeps), looks, deliveries

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-08 12:00:00

A session of a configured agent is served by *looks*, not by an event stream: a webhook or a
sweep asks for one (``sessions.look_requested_at``), one replica claims it (``look_owner``,
``look_expires_at``), reconciles the session and clears it. ``webhook_deliveries`` keeps each
verified webhook's id (a redelivery is taken once); ``agent_sweeps`` each agent's watermark and
sweep lease; ``replicas.intake_counts`` each replica's intake counts.

Nullable columns (and one with a constant default) are added in place on PostgreSQL; the new
tables are empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SESSION_COLUMNS = ("intake", "agent_id", "look_requested_at", "look_seq", "look_owner", "look_expires_at")


def upgrade() -> None:
    op.add_column("sessions", sa.Column("intake", sa.String(length=16), nullable=True))
    op.add_column("sessions", sa.Column("agent_id", sa.String(length=255), nullable=True))
    op.add_column("sessions", sa.Column("look_requested_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "sessions", sa.Column("look_seq", sa.BigInteger(), server_default=sa.text("0"), nullable=False)
    )
    op.add_column("sessions", sa.Column("look_owner", sa.String(length=255), nullable=True))
    op.add_column("sessions", sa.Column("look_expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(op.f("ix_sessions_look_requested_at"), "sessions", ["look_requested_at"], unique=False)
    op.add_column("replicas", sa.Column("intake_counts", sa.Text(), nullable=True))
    op.create_table(
        "webhook_deliveries",
        sa.Column("webhook_id", sa.String(length=255), nullable=False),
        sa.Column("event_type", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=255), nullable=True),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("webhook_id", name=op.f("pk_webhook_deliveries")),
    )
    op.create_index(
        op.f("ix_webhook_deliveries_received_at"), "webhook_deliveries", ["received_at"], unique=False
    )
    op.create_table(
        "agent_sweeps",
        sa.Column("agent_id", sa.String(length=255), nullable=False),
        sa.Column("watermark", sa.BigInteger(), nullable=True),
        sa.Column("resume_after", sa.String(length=255), nullable=True),
        sa.Column("runs", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("owner", sa.String(length=255), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_run_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_found", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("agent_id", name=op.f("pk_agent_sweeps")),
    )


def downgrade() -> None:
    op.drop_table("agent_sweeps")
    op.drop_index(op.f("ix_webhook_deliveries_received_at"), table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    # Native on both (SQLite since 3.35).
    op.execute("ALTER TABLE replicas DROP COLUMN intake_counts")
    op.drop_index(op.f("ix_sessions_look_requested_at"), table_name="sessions")
    for column in reversed(SESSION_COLUMNS):
        op.execute(f"ALTER TABLE sessions DROP COLUMN {column}")
