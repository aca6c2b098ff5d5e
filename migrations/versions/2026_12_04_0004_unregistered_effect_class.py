"""allow the effect class 'unregistered' on tool_calls

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04 18:45:00

A call naming a tool no handler is registered for was stored as 'read_only' (a lie an
operator sees in every listing). It now says 'unregistered'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Spelled out rather than imported: a migration must keep meaning what it meant when written.
OLD = "effect_class IN ('at_most_once', 'idempotent', 'read_only', 'transactional', 'verified')"
NEW = (
    "effect_class IN ('at_most_once', 'idempotent', 'read_only', 'transactional', 'verified', 'unregistered')"
)
NAME = "ck_tool_calls_effect_class"


def upgrade() -> None:
    _replace_check(NEW)


def downgrade() -> None:
    # The old constraint has no word for these calls; 'read_only' is what they were stored as.
    op.execute("UPDATE tool_calls SET effect_class = 'read_only' WHERE effect_class = 'unregistered'")
    _replace_check(OLD)


def _replace_check(condition: str) -> None:
    if op.get_bind().dialect.name == "postgresql":
        # NOT VALID then VALIDATE: the new check is added without holding the table's
        # exclusive lock for a scan of every call (validation takes a lighter lock).
        op.execute(f"ALTER TABLE tool_calls DROP CONSTRAINT {NAME}")
        op.execute(f"ALTER TABLE tool_calls ADD CONSTRAINT {NAME} CHECK ({condition}) NOT VALID")
        op.execute(f"ALTER TABLE tool_calls VALIDATE CONSTRAINT {NAME}")
        return
    _replace_sqlite_check(condition)


def _replace_sqlite_check(condition: str) -> None:
    """SQLite cannot alter a constraint: copy the table under its own CREATE statement with
    the one check changed (SQLite's documented procedure), indexes and all."""
    bind = op.get_bind()
    if bind.exec_driver_sql("PRAGMA foreign_keys").scalar():
        # With foreign keys on, dropping the old table would cascade to every call's events.
        raise RuntimeError("migration 0004 must run with PRAGMA foreign_keys=OFF on SQLite")
    table_sql, index_sqls = _sqlite_schema(bind)
    old_check = OLD if condition == NEW else NEW
    if table_sql.count(old_check) != 1:
        raise RuntimeError(f"tool_calls on SQLite does not hold the check {old_check!r} once")
    new_sql = table_sql.replace(old_check, condition).replace("tool_calls", "tool_calls_copy", 1)
    op.execute(new_sql)
    op.execute("INSERT INTO tool_calls_copy SELECT * FROM tool_calls")
    op.execute("DROP TABLE tool_calls")
    op.execute("ALTER TABLE tool_calls_copy RENAME TO tool_calls")
    for index_sql in index_sqls:
        op.execute(index_sql)


def _sqlite_schema(bind: Any) -> tuple[str, list[str]]:
    rows = bind.exec_driver_sql(
        "SELECT type, sql FROM sqlite_master WHERE tbl_name = 'tool_calls' AND sql IS NOT NULL"
    ).all()
    table_sql = next(sql for kind, sql in rows if kind == "table")
    return table_sql, [sql for kind, sql in rows if kind == "index"]
