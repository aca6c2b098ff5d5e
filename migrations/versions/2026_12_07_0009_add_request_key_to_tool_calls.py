"""add request_key to tool_calls (the request a stored result goes out in)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 19:30:00

Before a stored result is first posted, the request it goes out in is recorded: its
Idempotency-Key, which the members of a batch share. A resend after a crash replays exactly
that request (same key, same members, same bytes), or is not sent at all. Calls submitted
before this revision have none: they were sent under their own key or a batch's, which
nobody recorded.

A nullable column without a default: added in place on PostgreSQL, no rewrite, no long lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tool_calls", sa.Column("request_key", sa.String(length=64), nullable=True))


def downgrade() -> None:
    # Native on both (SQLite since 3.35): a batch copy of the table would lose the partial
    # indexes' predicates.
    op.execute("ALTER TABLE tool_calls DROP COLUMN request_key")
