"""add handler_load to replicas (how busy each serve's handlers are)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-08 10:00:00

Each `serve` writes, with its heartbeat, how its handlers stand: slots and threads taken,
threads whose handler timed out and still runs, calls waiting for either (JSON). `toolledger
status` shows it per replica: what holds a process's handlers is not in the calls' rows.

A nullable column without a default: added in place on PostgreSQL, no rewrite, no long lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("replicas", sa.Column("handler_load", sa.Text(), nullable=True))


def downgrade() -> None:
    # Native on both (SQLite since 3.35).
    op.execute("ALTER TABLE replicas DROP COLUMN handler_load")
