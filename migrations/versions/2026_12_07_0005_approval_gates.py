"""approval gates: the status 'awaiting_approval', and who decided, when, on what arguments

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07 02:30:00

A call of a tool declared ``approval=...`` is recorded 'awaiting_approval' and runs only once
a person approves it. That status is longer than the 16 characters a status column held, so
the status columns grow to 32. (The open-calls index learns the new status in 0006.)

On PostgreSQL the columns are added and grown in place (no rewrite), then the partial
indexes on the status are built again CONCURRENTLY, as a new ledger has them (growing the
type rewrote their predicates' casts): writes go on meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Spelled out rather than imported: a migration must keep meaning what it meant when written.
OLD_STATUSES = "status IN ('pending', 'running', 'succeeded', 'failed', 'unknown', 'submitted', 'abandoned')"
NEW_STATUSES = (
    "status IN ('pending', 'running', 'succeeded', 'failed', 'unknown', 'submitted', 'abandoned', "
    "'awaiting_approval')"
)
STATUS_CHECK = "ck_tool_calls_status"
OLD_OPEN = (
    "status IN ('pending', 'running', 'unknown', 'succeeded', 'failed') "
    "OR (status = 'submitted' AND confirmed_at IS NULL)"
)
OPEN_INDEX = "ix_tool_calls_open"
PARTIAL_INDEXES = {
    OPEN_INDEX: (["session_id"], OLD_OPEN),
    "ix_tool_calls_claimable": (
        ["status", "lease_expires_at"],
        "status IN ('pending', 'running', 'unknown', 'succeeded', 'failed')",
    ),
    "ix_tool_calls_unconfirmed": (["session_id"], "status = 'submitted' AND confirmed_at IS NULL"),
    "ix_tool_calls_prunable": (["updated_at"], "status IN ('submitted', 'abandoned')"),
}
"""Partial indexes whose predicates name the status: PostgreSQL rewrites their predicates'
casts when the column's type changes, so they are built again as a new ledger has them."""
NEW_COLUMNS = (
    ("approval_expires_at", "DATETIME", sa.DateTime(timezone=True)),
    ("approval_decided_by", "VARCHAR(255)", sa.String(255)),
    ("approval_decided_at", "DATETIME", sa.DateTime(timezone=True)),
    ("approved_arguments", "TEXT", sa.Text()),
    ("approved_arguments_sha256", "VARCHAR(64)", sa.String(64)),
)


def upgrade() -> None:
    if _dialect() == "postgresql":
        for name, _, column_type in NEW_COLUMNS:
            op.add_column("tool_calls", sa.Column(name, column_type))
        # Growing a varchar is a change of the catalogue alone: no rewrite, no index rebuilt.
        op.execute("ALTER TABLE tool_calls ALTER COLUMN status TYPE VARCHAR(32)")
        op.execute("ALTER TABLE tool_call_events ALTER COLUMN from_status TYPE VARCHAR(32)")
        op.execute("ALTER TABLE tool_call_events ALTER COLUMN to_status TYPE VARCHAR(32)")
        _replace_postgres_check(NEW_STATUSES)
        _rebuild_partial_indexes()
    else:
        _require_sqlite_foreign_keys_off()
        _rebuild_sqlite_table(
            "tool_calls",
            [
                ("status VARCHAR(16) NOT NULL", "status VARCHAR(32) NOT NULL"),
                (OLD_STATUSES, NEW_STATUSES),
                ("abandoned_reason TEXT, ", "abandoned_reason TEXT, " + _sqlite_new_columns()),
            ],
            new_columns=[name for name, _, _ in NEW_COLUMNS],
        )
        _rebuild_sqlite_table(
            "tool_call_events",
            [
                ("from_status VARCHAR(16)", "from_status VARCHAR(32)"),
                ("to_status VARCHAR(16)", "to_status VARCHAR(32)"),
            ],
        )


def downgrade() -> None:
    # The old schema has no word for a call awaiting approval: it was not yet run, and no
    # result exists, so 'pending' would run it unapproved; 'abandoned' runs nothing.
    op.execute(
        "UPDATE tool_calls SET status = 'abandoned', abandoned_reason = 'awaiting approval when "
        "the ledger was downgraded' WHERE status = 'awaiting_approval'"
    )
    op.execute("UPDATE tool_call_events SET to_status = 'abandoned' WHERE to_status = 'awaiting_approval'")
    op.execute(
        "UPDATE tool_call_events SET from_status = 'abandoned' WHERE from_status = 'awaiting_approval'"
    )
    if _dialect() == "postgresql":
        # The check goes first: the shorter type must not meet a status the old check allows not.
        _replace_postgres_check(OLD_STATUSES)
        op.execute("ALTER TABLE tool_call_events ALTER COLUMN from_status TYPE VARCHAR(16)")
        op.execute("ALTER TABLE tool_call_events ALTER COLUMN to_status TYPE VARCHAR(16)")
        op.execute("ALTER TABLE tool_calls ALTER COLUMN status TYPE VARCHAR(16)")
        # Both rewritten with the type's casts: as a ledger at 0004 has them, built again.
        _replace_postgres_check(OLD_STATUSES)
        _rebuild_partial_indexes()
        for name, _, _ in NEW_COLUMNS:
            op.drop_column("tool_calls", name)
    else:
        _require_sqlite_foreign_keys_off()
        _rebuild_sqlite_table(
            "tool_calls",
            [
                ("status VARCHAR(32) NOT NULL", "status VARCHAR(16) NOT NULL"),
                (NEW_STATUSES, OLD_STATUSES),
                ("abandoned_reason TEXT, " + _sqlite_new_columns(), "abandoned_reason TEXT, "),
            ],
            dropped_columns=[name for name, _, _ in NEW_COLUMNS],
        )
        _rebuild_sqlite_table(
            "tool_call_events",
            [
                ("from_status VARCHAR(32)", "from_status VARCHAR(16)"),
                ("to_status VARCHAR(32)", "to_status VARCHAR(16)"),
            ],
        )


def _dialect() -> str:
    return str(op.get_bind().dialect.name)


def _sqlite_new_columns() -> str:
    return "".join(f"\n\t{name} {sql_type}, " for name, sql_type, _ in NEW_COLUMNS)


def _replace_postgres_check(condition: str) -> None:
    # NOT VALID then VALIDATE: added without the table's exclusive lock for a scan of every call.
    op.execute(f"ALTER TABLE tool_calls DROP CONSTRAINT {STATUS_CHECK}")
    op.execute(f"ALTER TABLE tool_calls ADD CONSTRAINT {STATUS_CHECK} CHECK ({condition}) NOT VALID")
    op.execute(f"ALTER TABLE tool_calls VALIDATE CONSTRAINT {STATUS_CHECK}")


def _rebuild_partial_indexes() -> None:
    # CONCURRENTLY cannot run in a transaction: what came before is committed first.
    with op.get_context().autocommit_block():
        for name, (columns, condition) in PARTIAL_INDEXES.items():
            rebuild_concurrently(name, columns, condition)


def rebuild_concurrently(name: str, columns: list[str], condition: str) -> None:
    """Build the index again beside the old one, then swap: at no moment is there none, and
    no write waits for a build. A build cut short leaves ``*_rebuilt`` invalid: dropped first
    when the upgrade runs again."""
    rebuilt = f"{name}_rebuilt"
    op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {rebuilt}")
    op.create_index(
        rebuilt, "tool_calls", columns, postgresql_where=sa.text(condition), postgresql_concurrently=True
    )
    op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    op.execute(f"ALTER INDEX {rebuilt} RENAME TO {name}")


def _require_sqlite_foreign_keys_off() -> None:
    if op.get_bind().exec_driver_sql("PRAGMA foreign_keys").scalar():
        # With foreign keys on, dropping the old table would cascade to every call's events.
        raise RuntimeError("migration 0005 must run with PRAGMA foreign_keys=OFF on SQLite")


def _rebuild_sqlite_table(
    table: str,
    replacements: list[tuple[str, str]],
    *,
    new_columns: Sequence[str] = (),
    dropped_columns: Sequence[str] = (),
) -> None:
    """SQLite cannot alter a column or a constraint: copy the table under its own CREATE
    statement with the given pieces replaced (SQLite's documented procedure), indexes and all."""
    bind = op.get_bind()
    table_sql, index_sqls = _sqlite_schema(bind, table)
    for old, new in replacements:
        if table_sql.count(old) != 1:
            raise RuntimeError(f"{table} on SQLite does not hold {old!r} once")
        table_sql = table_sql.replace(old, new)
    copy = f"{table}_copy"
    op.execute(table_sql.replace(f'"{table}"', copy, 1).replace(f"TABLE {table} ", f"TABLE {copy} ", 1))
    old_columns = [row[1] for row in bind.exec_driver_sql(f"PRAGMA table_info({table})").all()]
    kept = [c for c in old_columns if c not in dropped_columns and c not in new_columns]
    listed = ", ".join(kept)
    op.execute(f"INSERT INTO {copy} ({listed}) SELECT {listed} FROM {table}")  # noqa: S608 (our own names)
    op.execute(f"DROP TABLE {table}")
    op.execute(f"ALTER TABLE {copy} RENAME TO {table}")
    for index_sql in index_sqls:
        op.execute(index_sql)


def _sqlite_schema(bind: Any, table: str) -> tuple[str, list[str]]:
    rows = bind.exec_driver_sql(
        "SELECT type, sql FROM sqlite_master WHERE tbl_name = ? AND sql IS NOT NULL", (table,)
    ).all()
    table_sql = next(sql for kind, sql in rows if kind == "table")
    return table_sql, [sql for kind, sql in rows if kind == "index"]
