"""create ledger tables

Revision ID: 0001
Revises:
Create Date: 2026-12-02 19:08:32.169440
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.String(length=255), nullable=False),
        sa.Column("watched", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("owner", sa.String(length=255), nullable=True),
        sa.Column("lease_token", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_event_id", sa.String(length=255), nullable=True),
        sa.Column("last_polled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("status", sa.String(length=32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_sessions")),
    )
    op.create_table(
        "tool_calls",
        sa.Column("session_id", sa.String(length=255), nullable=False),
        sa.Column("turn_id", sa.String(length=255), nullable=False),
        sa.Column("call_id", sa.String(length=255), nullable=False),
        sa.Column("tool_name", sa.String(length=255), nullable=False),
        sa.Column("arguments", sa.Text(), nullable=False),
        sa.Column("arguments_sha256", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("effect_class", sa.String(length=16), nullable=False),
        sa.Column("idempotency_key", sa.String(length=64), nullable=False),
        sa.Column("attempt_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("lease_owner", sa.String(length=255), nullable=True),
        sa.Column("lease_token", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("error_stage", sa.String(length=16), nullable=True),
        sa.Column("error_detail", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("submitted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("confirmed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("submission_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_submission_error", sa.Text(), nullable=True),
        sa.Column("abandoned_reason", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "effect_class IN ('at_most_once', 'idempotent', 'read_only', 'transactional', 'verified')",
            name=op.f("ck_tool_calls_effect_class"),
        ),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'succeeded', 'failed', 'unknown', 'submitted', 'abandoned')",
            name=op.f("ck_tool_calls_status"),
        ),
        sa.PrimaryKeyConstraint("session_id", "turn_id", "call_id", name=op.f("pk_tool_calls")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_tool_calls_idempotency_key")),
    )
    op.create_index(
        "ix_tool_calls_claimable",
        "tool_calls",
        ["status", "lease_expires_at"],
        unique=False,
        postgresql_where=sa.text("status IN ('pending', 'running', 'unknown', 'succeeded', 'failed')"),
        sqlite_where=sa.text("status IN ('pending', 'running', 'unknown', 'succeeded', 'failed')"),
    )
    op.create_index("ix_tool_calls_created_at", "tool_calls", ["created_at"], unique=False)
    op.create_index(
        "ix_tool_calls_tool_name_created_at", "tool_calls", ["tool_name", "created_at"], unique=False
    )
    op.create_index(
        "ix_tool_calls_unconfirmed",
        "tool_calls",
        ["session_id"],
        unique=False,
        postgresql_where=sa.text("status = 'submitted' AND confirmed_at IS NULL"),
        sqlite_where=sa.text("status = 'submitted' AND confirmed_at IS NULL"),
    )

    op.create_table(
        "tool_call_events",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("session_id", sa.String(length=255), nullable=False),
        sa.Column("turn_id", sa.String(length=255), nullable=False),
        sa.Column("call_id", sa.String(length=255), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("from_status", sa.String(length=16), nullable=True),
        sa.Column("to_status", sa.String(length=16), nullable=True),
        sa.Column("lease_token", sa.BigInteger(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["session_id", "turn_id", "call_id"],
            ["tool_calls.session_id", "tool_calls.turn_id", "tool_calls.call_id"],
            name=op.f("fk_tool_call_events_session_id_tool_calls"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tool_call_events")),
    )
    op.create_index("ix_tool_call_events_at", "tool_call_events", ["at"], unique=False)
    op.create_index(
        "ix_tool_call_events_call",
        "tool_call_events",
        ["session_id", "turn_id", "call_id", "id"],
        unique=False,
    )

    if op.get_bind().dialect.name == "postgresql":
        # Claims churn this table: vacuum it early so dead index entries don't slow claims.
        op.execute(
            "ALTER TABLE tool_calls SET (autovacuum_vacuum_scale_factor = 0.01, "
            "autovacuum_analyze_scale_factor = 0.02, fillfactor = 90)"
        )


def downgrade() -> None:
    # Dropping a table drops its indexes and constraints with it.
    op.drop_table("tool_call_events")
    op.drop_table("tool_calls")
    op.drop_table("sessions")
