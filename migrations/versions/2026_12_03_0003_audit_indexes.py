"""add audit indexes to tool_calls

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 10:30:00

Audit views over millions of calls: a call found by its id alone, listings sorted by status or
by tool, pruning in batches, and (PostgreSQL) substring search through pg_trgm.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger(__name__)

# Spelled out rather than imported: a migration must keep meaning what it meant when written.
PRUNABLE_SQL = "status IN ('submitted', 'abandoned')"
SEARCH_COLUMNS = ("tool_name", "session_id", "turn_id", "call_id")

BTREE_INDEXES: tuple[tuple[str, list[str], dict[str, Any]], ...] = (
    ("ix_tool_calls_call_id", ["call_id"], {}),
    ("ix_tool_calls_status_key", ["status", "session_id", "turn_id", "call_id"], {}),
    ("ix_tool_calls_tool_name_key", ["tool_name", "session_id", "turn_id", "call_id"], {}),
    (
        "ix_tool_calls_prunable",
        ["updated_at"],
        {"postgresql_where": sa.text(PRUNABLE_SQL), "sqlite_where": sa.text(PRUNABLE_SQL)},
    ),
)
SEARCH_INDEX = "ix_tool_calls_search"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        for name, columns, options in BTREE_INDEXES:
            op.create_index(name, "tool_calls", columns, unique=False, **options)
        return
    with_search = _trigrams_available()
    # A plain CREATE INDEX blocks every write to tool_calls while it builds (a minute or more
    # at a million calls): heartbeats would wait, leases run out, running calls turn unknown.
    # CONCURRENTLY lets the ledger keep working; it cannot run inside a transaction.
    with op.get_context().autocommit_block():
        for name, columns, options in BTREE_INDEXES:
            _drop_if_invalid(name)
            op.create_index(
                name, "tool_calls", columns, unique=False, postgresql_concurrently=True, **options
            )
        if with_search:
            _drop_if_invalid(SEARCH_INDEX)
            op.create_index(
                SEARCH_INDEX,
                "tool_calls",
                [sa.text(f"lower({column}) gin_trgm_ops") for column in SEARCH_COLUMNS],
                unique=False,
                postgresql_using="gin",
                postgresql_concurrently=True,
            )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # IF EXISTS: the upgrade leaves it out where pg_trgm could not be installed. The
        # extension stays: other objects in the database may use it.
        op.execute(f"DROP INDEX IF EXISTS {SEARCH_INDEX}")
    for name, _columns, options in reversed(BTREE_INDEXES):
        op.drop_index(name, table_name="tool_calls", **options)


def _trigrams_available() -> bool:
    """Install pg_trgm if needed. It ships with PostgreSQL and is a trusted extension (any
    role that may create objects in the database can install it), but a server built without
    contrib, or a role without that right, refuses: the ledger then works without the search
    index (a search scans the table) rather than failing to upgrade."""
    bind = op.get_bind()
    try:
        # A savepoint: a refused CREATE EXTENSION must not abort the migration's transaction.
        with bind.begin_nested():
            bind.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    except sa.exc.DBAPIError as error:
        log.warning("pg_trgm is not available (%s): free-text search will scan tool_calls", error.orig)
        return False
    return True


def _drop_if_invalid(name: str) -> None:
    """A concurrent build that failed (cancelled, or the migration was killed) leaves an
    invalid index behind, which would make this upgrade fail again: drop it first."""
    invalid = op.get_bind().execute(
        sa.text(
            "SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = :name AND NOT i.indisvalid"
        ),
        {"name": name},
    )
    if invalid.first() is not None:
        op.execute(f"DROP INDEX CONCURRENTLY {name}")
