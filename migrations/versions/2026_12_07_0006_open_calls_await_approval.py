"""the open-calls index covers calls awaiting approval

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07 03:10:00

A session with a call awaiting approval still awaits it: after a restart `serve` must watch
that session again (``SessionStore.with_open_calls``), and the index it reads by must hold
those calls. Built CONCURRENTLY on PostgreSQL beside the old one, then swapped.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Spelled out rather than imported: a migration must keep meaning what it meant when written.
OLD_OPEN = (
    "status IN ('pending', 'running', 'unknown', 'succeeded', 'failed') "
    "OR (status = 'submitted' AND confirmed_at IS NULL)"
)
NEW_OPEN = (
    "status IN ('pending', 'running', 'unknown', 'succeeded', 'failed', 'awaiting_approval') "
    "OR (status = 'submitted' AND confirmed_at IS NULL)"
)
OPEN_INDEX = "ix_tool_calls_open"


def upgrade() -> None:
    _replace_open_index(NEW_OPEN)


def downgrade() -> None:
    _replace_open_index(OLD_OPEN)


def _replace_open_index(condition: str) -> None:
    if op.get_bind().dialect.name == "postgresql":
        # Beside the old one, then swapped: at no moment is there none, and no write waits for
        # the build. A build cut short leaves the new name invalid: dropped when run again.
        rebuilt = f"{OPEN_INDEX}_rebuilt"
        with op.get_context().autocommit_block():
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {rebuilt}")
            op.create_index(
                rebuilt,
                "tool_calls",
                ["session_id"],
                postgresql_where=sa.text(condition),
                postgresql_concurrently=True,
            )
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {OPEN_INDEX}")
            op.execute(f"ALTER INDEX {rebuilt} RENAME TO {OPEN_INDEX}")
        return
    op.drop_index(OPEN_INDEX, table_name="tool_calls")
    op.create_index(OPEN_INDEX, "tool_calls", ["session_id"], sqlite_where=sa.text(condition))
