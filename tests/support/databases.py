"""Real databases for tests: a migrated SQLite file, or a PostgreSQL database cloned per test.

PostgreSQL comes from TOOLLEDGER_TEST_DATABASE_URL, else the server on 127.0.0.1:5432. A
template database is migrated once per test run (``alembic upgrade head``) and each test
gets ``CREATE DATABASE ... TEMPLATE`` of it, which other processes can use too.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy import pool, text
from sqlalchemy.engine import make_url

from toolledger.store import migrate
from toolledger.store.engine import sync_url

NewDatabase = Callable[[], str]
"""Makes an empty database (no tables at all) each time it is called (the ``new_database``
fixture)."""

DEFAULT_SERVER_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def server_url() -> str:
    return os.environ.get("TOOLLEDGER_TEST_DATABASE_URL", DEFAULT_SERVER_URL)


def _libpq(url: str, database: str | None = None) -> str:
    parsed = make_url(url)
    if database is not None:
        parsed = parsed.set(database=database)
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


def _with_database(url: str, database: str) -> str:
    return make_url(url).set(database=database).render_as_string(hide_password=False)


class PostgresTemplate:
    """One migrated template per test run; a fresh clone per test."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.name = f"toolledger_template_{os.getpid()}"

    def admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(_libpq(self.base_url), autocommit=True, connect_timeout=5)

    def create(self) -> None:
        with self.admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name)))
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        migrate.upgrade(_with_database(self.base_url, self.name))

    def drop(self) -> None:
        with self.admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name)))

    @contextmanager
    def clone(self, *, migrated: bool = True) -> Iterator[str]:
        name = f"toolledger_test_{uuid.uuid4().hex[:12]}"
        with self.admin() as conn:
            if migrated:
                conn.execute(
                    sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                        sql.Identifier(name), sql.Identifier(self.name)
                    )
                )
            else:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield _with_database(self.base_url, name)
        finally:
            with self.admin() as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def connect(url: str, database: str | None = None) -> psycopg.Connection[tuple[object, ...]]:
    """An autocommit psycopg connection to the database of ``url`` (or to ``database``
    on its server)."""
    return psycopg.connect(_libpq(url, database), autocommit=True, connect_timeout=5)


def databases_named(url: str, prefix: str) -> set[str]:
    """The databases of ``url``'s server whose names start with ``prefix``."""
    with connect(url) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE starts_with(datname, %s)", (prefix,))
        return {str(name) for (name,) in rows.fetchall()}


def drop_databases_named(url: str, prefix: str) -> None:
    with connect(url) as conn:
        for name in databases_named(url, prefix):
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def postgres_available(url: str) -> bool:
    try:
        psycopg.connect(_libpq(url), connect_timeout=3).close()
    except psycopg.OperationalError:
        return False
    return True


def require_postgres(url: str) -> None:
    """Skip on a developer machine without PostgreSQL; in CI a missing server is a failure."""
    if postgres_available(url):
        return
    message = f"PostgreSQL is not reachable at {make_url(url).render_as_string()}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


LATER_COLUMNS = (
    ("0009", "tool_calls", "request_key", "VARCHAR(64)"),
    ("0011", "tool_call_events", "content_sha256", "VARCHAR(64)"),
    ("0011", "tool_call_events", "trail_mac", "VARCHAR(100)"),
)
"""The columns that revisions after 0008 add and today's store writes (every statement of it
returns whole rows, and names every column of an event it inserts): 0009's ``request_key``,
0011's ``content_sha256`` and ``trail_mac``. A ledger at an older revision that today's store
must write to (to stand for the running release, as a migration test does) gets them by hand
first (those of revisions after the one it is at), and loses them again before it is migrated
on (``without_later_columns``): the events
written meanwhile then carry no content digest, as the release before 0011 wrote them (its
trigger hashed them without one)."""


def with_later_columns(url: str) -> None:
    _alter(
        url, tuple(f"ALTER TABLE {table} ADD COLUMN {column} {kind}" for table, column, kind in _later(url))
    )


def without_later_columns(url: str) -> None:
    _alter(url, tuple(f"ALTER TABLE {table} DROP COLUMN {column}" for table, column, _ in _later(url)))


def _later(url: str) -> list[tuple[str, str, str]]:
    at = migrate.current_revision(url) or "0000"
    return [(table, column, kind) for revision, table, column, kind in LATER_COLUMNS if revision > at]


def _alter(url: str, statements: tuple[str, ...]) -> None:
    engine = create_sync_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(text(statement))
    finally:
        engine.dispose()
