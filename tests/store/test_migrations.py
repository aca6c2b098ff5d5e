"""The shipped Alembic migrations, on a real SQLite file and a real (empty) PostgreSQL database.

From empty to head and back, one revision at a time; the migrated schema against the SQLAlchemy
metadata (Alembic autogenerate, and a reflection of what ``metadata.create_all`` builds, which
also covers partial-index predicates and check constraints); and ``toolledger migrate``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Index, MetaData, create_engine, inspect, pool, text

from tests.support.databases import NewDatabase, PostgresTemplate
from tests.support.paths import ROOT
from toolledger.store import migrate
from toolledger.store.engine import sync_url
from toolledger.store.schema import metadata

LEDGER_TABLES = {"tool_calls", "tool_call_events", "sessions"}
VERSION_TABLE = "alembic_version"
TOOLLEDGER_BIN = Path(sys.executable).with_name("toolledger")


@pytest.fixture
def empty_url(new_database: NewDatabase) -> str:
    return new_database()


def sync_engine_for(url: str) -> Any:
    return create_engine(sync_url(url), poolclass=pool.NullPool)


def table_names(url: str) -> set[str]:
    engine = sync_engine_for(url)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


def version_rows(url: str) -> list[str]:
    engine = sync_engine_for(url)
    try:
        with engine.connect() as conn:
            return [row[0] for row in conn.execute(text("SELECT version_num FROM alembic_version"))]
    finally:
        engine.dispose()


def revisions_base_to_head(url: str) -> list[tuple[str, str | None]]:
    """(revision, down_revision) of every migration, oldest first."""
    script = ScriptDirectory.from_config(migrate.alembic_config(url))
    steps: list[tuple[str, str | None]] = []
    for revision in script.walk_revisions():
        down = revision.down_revision
        assert down is None or isinstance(down, str), f"{revision.revision} merges branches"
        steps.append((revision.revision, down))
    return steps[::-1]


def autogenerate_diff(url: str, target: MetaData = metadata) -> list[Any]:
    """What ``alembic revision --autogenerate`` would write: tables, columns, types, server
    defaults, nullability, indexes, unique constraints and foreign keys."""
    engine = sync_engine_for(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            return list(compare_metadata(context, target))
    finally:
        engine.dispose()


def _squeeze(sql: object) -> str:
    return " ".join(str(sql).split())


def schema_snapshot(url: str) -> dict[str, Any]:
    """The ledger schema as the database reports it, ignoring column order and Alembic's table."""
    engine = sync_engine_for(url)
    snapshot: dict[str, Any] = {}
    try:
        with engine.connect() as conn:
            inspector = inspect(conn)
            for table in sorted(set(inspector.get_table_names()) - {VERSION_TABLE}):
                columns = {
                    column["name"]: (
                        str(column["type"].compile(dialect=conn.dialect)),
                        column["nullable"],
                        _squeeze(column["default"]) if column.get("default") is not None else None,
                    )
                    for column in inspector.get_columns(table)
                }
                indexes = {
                    index["name"]: (
                        tuple(index["column_names"]),
                        bool(index["unique"]),
                        {key: _squeeze(value) for key, value in index.get("dialect_options", {}).items()},
                    )
                    for index in inspector.get_indexes(table)
                }
                snapshot[table] = {
                    "columns": columns,
                    "primary_key": inspector.get_pk_constraint(table),
                    "foreign_keys": sorted(
                        (
                            fk["name"] or "",
                            tuple(fk["constrained_columns"]),
                            fk["referred_table"],
                            tuple(fk["referred_columns"]),
                            tuple(sorted(fk["options"].items())),
                        )
                        for fk in inspector.get_foreign_keys(table)
                    ),
                    "unique": sorted(
                        (uq["name"] or "", tuple(uq["column_names"]))
                        for uq in inspector.get_unique_constraints(table)
                    ),
                    "checks": sorted(
                        (ck["name"] or "", _squeeze(ck["sqltext"]))
                        for ck in inspector.get_check_constraints(table)
                    ),
                    "indexes": indexes,
                }
    finally:
        engine.dispose()
    return snapshot


def create_all(url: str, target: MetaData = metadata) -> None:
    engine = sync_engine_for(url)
    try:
        target.create_all(engine)
    finally:
        engine.dispose()


def copy_of_metadata() -> MetaData:
    copy = MetaData(naming_convention=metadata.naming_convention)
    for table in metadata.sorted_tables:
        table.to_metadata(copy)
    return copy


# --- up, down, and up again ---------------------------------------------------------------------


def test_migrations__script_directory__has_exactly_one_head_reachable_from_base(empty_url: str) -> None:
    script = ScriptDirectory.from_config(migrate.alembic_config(empty_url))
    steps = revisions_base_to_head(empty_url)

    assert script.get_heads() == [migrate.head_revision(empty_url)]
    assert migrate.head_revision(empty_url) == migrate.HEAD, "migrate.HEAD names the newest revision"
    assert steps[0][1] is None
    assert steps[-1][0] == migrate.head_revision(empty_url)
    assert [down for _, down in steps[1:]] == [revision for revision, _ in steps[:-1]]


def test_upgrade__empty_database_to_head__creates_every_table_and_reports_current(empty_url: str) -> None:
    head = migrate.head_revision(empty_url)
    assert head is not None
    assert table_names(empty_url) == set()
    assert migrate.current_revision(empty_url) is None
    assert migrate.is_current(empty_url) is False

    migrate.upgrade(empty_url)

    tables = table_names(empty_url)
    assert tables >= LEDGER_TABLES | {VERSION_TABLE}
    assert tables == set(metadata.tables) | {VERSION_TABLE}
    assert version_rows(empty_url) == [head]
    assert migrate.current_revision(empty_url) == head
    assert migrate.is_current(empty_url) is True


def test_upgrade__database_already_at_head__changes_nothing(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    before = schema_snapshot(empty_url)

    migrate.upgrade(empty_url)

    assert schema_snapshot(empty_url) == before
    assert version_rows(empty_url) == [migrate.head_revision(empty_url)]


def test_downgrade__head_to_base__removes_every_ledger_table(empty_url: str) -> None:
    migrate.upgrade(empty_url)

    migrate.downgrade(empty_url, "base")

    assert table_names(empty_url) == {VERSION_TABLE}  # Alembic keeps its (now empty) table
    assert version_rows(empty_url) == []
    assert migrate.current_revision(empty_url) is None
    assert migrate.is_current(empty_url) is False


def test_upgrade__after_downgrade_to_base__rebuilds_the_same_schema(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    first = schema_snapshot(empty_url)
    migrate.downgrade(empty_url, "base")

    migrate.upgrade(empty_url)

    assert schema_snapshot(empty_url) == first
    assert migrate.is_current(empty_url) is True
    assert autogenerate_diff(empty_url) == []


def test_each_revision__downgrades_and_upgrades_again_one_step_at_a_time(empty_url: str) -> None:
    steps = revisions_base_to_head(empty_url)
    head = migrate.head_revision(empty_url)
    snapshots: dict[str | None, dict[str, Any]] = {None: schema_snapshot(empty_url)}

    for revision, down in steps:
        migrate.upgrade(empty_url, revision)
        snapshots[revision] = schema_snapshot(empty_url)
        assert migrate.current_revision(empty_url) == revision
        assert migrate.is_current(empty_url) is (revision == head)

        migrate.downgrade(empty_url, down or "base")
        assert migrate.current_revision(empty_url) == down
        assert schema_snapshot(empty_url) == snapshots[down], f"downgrade of {revision} left changes"

        migrate.upgrade(empty_url, revision)
        assert schema_snapshot(empty_url) == snapshots[revision], f"{revision} differs when run again"

    for revision, down in reversed(steps):
        assert migrate.current_revision(empty_url) == revision
        migrate.downgrade(empty_url, down or "base")
        assert schema_snapshot(empty_url) == snapshots[down]
    assert table_names(empty_url) <= {VERSION_TABLE}


def test_upgrade_0004__calls_and_their_events_kept__unregistered_allowed__downgrade_maps_it_back(
    empty_url: str,
) -> None:
    """0004 copies tool_calls on SQLite: no call, no event (a cascade would delete them) and no
    other constraint may be lost on the way."""
    migrate.upgrade(empty_url, "0003")
    insert_call = text(
        "INSERT INTO tool_calls (session_id, turn_id, call_id, tool_name, arguments, arguments_sha256, "
        "status, effect_class, idempotency_key, created_at, updated_at) "
        "VALUES ('s', 't', :call_id, 'charge', '{}', 'x', 'pending', :effect, :call_id, :now, :now)"
    )
    now = datetime(2026, 12, 4, 18, tzinfo=UTC)
    engine = sync_engine_for(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(insert_call, {"call_id": "c", "effect": "at_most_once", "now": now})
            conn.execute(
                text(
                    "INSERT INTO tool_call_events (session_id, turn_id, call_id, at, actor, kind) "
                    "VALUES ('s', 't', 'c', :now, 'w', 'recorded')"
                ),
                {"now": now},
            )
        migrate.upgrade(empty_url)
        with engine.begin() as conn:
            conn.execute(insert_call, {"call_id": "c2", "effect": "unregistered", "now": now})
            with pytest.raises(Exception, match=r"(?i)check"), conn.begin_nested():
                conn.execute(text("UPDATE tool_calls SET status = 'bogus' WHERE call_id = 'c'"))
            assert conn.execute(text("SELECT count(*) FROM tool_call_events")).scalar() == 1
            assert conn.execute(text("SELECT count(*) FROM tool_calls")).scalar() == 2
        migrate.downgrade(empty_url, "0003")
        with engine.connect() as conn:
            effects = conn.execute(text("SELECT call_id, effect_class FROM tool_calls ORDER BY call_id"))
            assert effects.all() == [("c", "at_most_once"), ("c2", "read_only")]
            assert conn.execute(text("SELECT count(*) FROM tool_call_events")).scalar() == 1
    finally:
        engine.dispose()


# --- no drift between migrations and metadata --------------------------------------------------------


def test_migrated_schema__compared_with_metadata_by_autogenerate__has_no_differences(empty_url: str) -> None:
    migrate.upgrade(empty_url)

    assert autogenerate_diff(empty_url) == []


def test_migrated_schema__reflected__equals_the_schema_create_all_builds(new_database: NewDatabase) -> None:
    migrated, reference = new_database(), new_database()
    migrate.upgrade(migrated)
    create_all(reference)

    migrated_schema, reference_schema = schema_snapshot(migrated), schema_snapshot(reference)

    assert set(migrated_schema) == set(metadata.tables)
    for table in sorted(reference_schema):
        for part in reference_schema[table]:
            assert migrated_schema[table][part] == reference_schema[table][part], f"{table} {part} drifted"
    partial = {name for name, (_, _, options) in migrated_schema["tool_calls"]["indexes"].items() if options}
    assert {"ix_tool_calls_claimable", "ix_tool_calls_unconfirmed"} <= partial


def test_drift_checks__given_a_deliberately_different_schema__report_the_differences(
    new_database: NewDatabase,
) -> None:
    migrated, reference = new_database(), new_database()
    migrate.upgrade(migrated)
    changed = copy_of_metadata()
    Index("ix_sessions_status", changed.tables["sessions"].c.status)
    claimable = next(
        ix for ix in changed.tables["tool_calls"].indexes if ix.name == "ix_tool_calls_claimable"
    )
    claimable.dialect_kwargs["sqlite_where"] = text("status = 'pending'")
    claimable.dialect_kwargs["postgresql_where"] = text("status = 'pending'")
    create_all(reference, changed)

    diff = autogenerate_diff(migrated, changed)
    migrated_schema, reference_schema = schema_snapshot(migrated), schema_snapshot(reference)

    assert [(d[0], d[1].name) for d in diff if isinstance(d, tuple)] == [("add_index", "ix_sessions_status")]
    assert len(diff) == 1
    assert migrated_schema["tool_calls"]["indexes"] != reference_schema["tool_calls"]["indexes"]
    assert migrated_schema["tool_calls"]["columns"] == reference_schema["tool_calls"]["columns"]


def test_upgrade__postgresql__tunes_autovacuum_and_fillfactor_of_tool_calls(
    postgres_template: PostgresTemplate,
) -> None:
    with postgres_template.clone(migrated=False) as url:
        migrate.upgrade(url)
        engine = sync_engine_for(url)
        try:
            with engine.connect() as conn:
                options = conn.execute(
                    text("SELECT reloptions FROM pg_class WHERE relname = 'tool_calls'")
                ).scalar_one()
        finally:
            engine.dispose()

    assert set(options) == {
        "autovacuum_vacuum_scale_factor=0.01",
        "autovacuum_analyze_scale_factor=0.02",
        "fillfactor=90",
    }


def test_alembic_ini__developer_config__runs_the_same_migrations(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite3'}"
    config = Config(str(ROOT / "alembic.ini"))
    config.attributes["database_url"] = url

    assert ScriptDirectory.from_config(config).get_current_head() == migrate.head_revision(url)
    command.upgrade(config, "head")
    assert migrate.is_current(url) is True
    assert autogenerate_diff(url) == []


# --- toolledger migrate ---------------------------------------------------------------------------------


def run_cli(
    *arguments: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("TOOLLEDGER_")}
    return subprocess.run(
        [str(TOOLLEDGER_BIN), *arguments],
        cwd=cwd,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_migrate__fresh_sqlite_file__upgrades_is_idempotent_and_downgrades(tmp_path: Path) -> None:
    path = tmp_path / "cli.sqlite3"
    url = f"sqlite:///{path}"  # the usual spelling; settings pick the async driver
    head = migrate.head_revision(url)

    first = run_cli("migrate", "--database-url", url, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == f"ledger schema: empty -> {head}"
    assert path.is_file()
    assert table_names(url) == set(metadata.tables) | {VERSION_TABLE}
    assert migrate.is_current(url) is True
    assert autogenerate_diff(url) == []

    again = run_cli("migrate", "--database-url", url, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"ledger schema: {head} -> {head}"

    down = run_cli("migrate", "--database-url", url, "--downgrade", "--revision", "base", cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == f"ledger schema: {head} -> empty"
    assert table_names(url) == {VERSION_TABLE}


def test_cli_migrate__database_url_from_environment__migrates_that_database(tmp_path: Path) -> None:
    path = tmp_path / "from-env.sqlite3"
    url = f"sqlite+aiosqlite:///{path}"

    result = run_cli("migrate", cwd=tmp_path, env={"TOOLLEDGER_DATABASE_URL": url})

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ledger schema: empty -> {migrate.head_revision(url)}"
    assert migrate.is_current(url) is True
    assert not (tmp_path / "toolledger.sqlite3").exists()  # not the default database
