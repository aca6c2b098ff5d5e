"""The conformance check's throwaway ledgers on a real PostgreSQL server (and the refusals of
what cannot hold them): a database per run, copied from a template, dropped when done."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from tests.support.databases import (
    connect,
    databases_named,
    drop_databases_named,
    require_postgres,
    server_url,
)
from toolledger.testing import CheckError
from toolledger.testing.ledgers import DATABASE_PREFIX, PostgresLedgers, SqliteLedgers, throwaway_ledgers


@pytest.fixture
def server() -> str:
    url = server_url()
    require_postgres(url)
    return url


def _prefix(url: str) -> str:
    """The check's own prefix, from its template's name (``<prefix>_template``)."""
    name = str(make_url(url).database)
    assert name.startswith(DATABASE_PREFIX), name
    assert name.endswith("_template"), name
    return name.removesuffix("template")


def test_postgres_ledgers__each_run_gets_a_copy_of_the_template__dropped_after(
    server: str, tmp_path: Path
) -> None:
    ledgers = throwaway_ledgers(tmp_path, server, keep=False)
    prefix = _prefix(ledgers.template_url)
    try:
        with ledgers:
            assert isinstance(ledgers, PostgresLedgers)
            with connect(ledgers.template_url) as template:
                template.execute("CREATE TABLE migrated (n integer)")
                template.execute("INSERT INTO migrated VALUES (1)")
            (tmp_path / "a").mkdir()
            (tmp_path / "b").mkdir()
            first, second = ledgers.fresh(tmp_path / "a"), ledgers.fresh(tmp_path / "b")

            # Each run's database is its own copy: a write to one is not seen in the other.
            with connect(first) as run:
                run.execute("INSERT INTO migrated VALUES (2)")
            with connect(second) as run:
                assert run.execute("SELECT n FROM migrated").fetchall() == [(1,)]
            assert make_url(first).database != make_url(second).database
            assert (tmp_path / "b" / "ledger.txt").read_text() == (
                f"PostgreSQL database {make_url(second).database}\n"
            )
            # The URLs keep the driver toolledger runs on.
            assert make_url(first).drivername == "postgresql+psycopg"

            ledgers.discard(first)
            assert databases_named(server, prefix) == {
                str(make_url(ledgers.template_url).database),
                str(make_url(second).database),
            }
        # Closing drops what is left, the template too.
        assert databases_named(server, prefix) == set()
    finally:
        drop_databases_named(server, prefix)


def test_postgres_ledgers__kept__leaves_every_database_for_a_look(server: str, tmp_path: Path) -> None:
    ledgers = throwaway_ledgers(tmp_path, server.replace("postgresql+psycopg://", "postgres://"), keep=True)
    prefix = _prefix(ledgers.template_url)
    try:
        with ledgers:
            run = ledgers.fresh(tmp_path)
            ledgers.discard(run)
        assert databases_named(server, prefix) == {
            str(make_url(ledgers.template_url).database),
            str(make_url(run).database),
        }
    finally:
        drop_databases_named(server, prefix)


@pytest.fixture
def role_without_createdb(server: str) -> Iterator[str]:
    role = f"toolledger_test_{uuid.uuid4().hex[:8]}"
    with connect(server) as connection:
        connection.execute(sql.SQL("CREATE ROLE {} LOGIN NOCREATEDB").format(sql.Identifier(role)))
    yield role
    with connect(server) as connection:
        connection.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_postgres_ledgers__role_without_createdb__is_told_what_it_needs(
    server: str, role_without_createdb: str, tmp_path: Path
) -> None:
    url = make_url(server).set(username=role_without_createdb, password="not-shown")  # noqa: S106

    with pytest.raises(CheckError) as raised:
        throwaway_ledgers(tmp_path, url.render_as_string(hide_password=False), keep=False)

    said = str(raised.value)
    assert said.startswith("could not make a throwaway database on postgresql+psycopg://")
    assert said.endswith(
        "permission denied to create database "
        f"(the role needs CREATEDB: ALTER ROLE {role_without_createdb} CREATEDB)"
    )
    assert "not-shown" not in said
    assert raised.value.param is None  # not bad usage: the check could not be made (exit 3)


def test_throwaway_ledgers__no_server_there__says_it_could_notconnect(tmp_path: Path) -> None:
    with pytest.raises(
        CheckError, match=r"^could not make a throwaway database on .*:1/test: connection failed"
    ):
        throwaway_ledgers(tmp_path, "postgresql://postgres@127.0.0.1:1/test", keep=False)


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("sqlite:///elsewhere.sqlite3", "expected a PostgreSQL server to make the throwaway databases on"),
        ("mysql://root@localhost/test", "mysql is not supported"),
        ("postgresql://host:port/test", "not a database URL"),
    ],
)
def test_throwaway_ledgers__not_a_postgresql_server__is_refused(url: str, said: str, tmp_path: Path) -> None:
    with pytest.raises(CheckError, match=said) as raised:
        throwaway_ledgers(tmp_path, url, keep=False)

    assert raised.value.param == "--database-url"


def test_throwaway_ledgers__by_default__are_sqlite_files_in_the_check_s_directory(tmp_path: Path) -> None:
    ledgers = throwaway_ledgers(tmp_path, None, keep=False)

    assert isinstance(ledgers, SqliteLedgers)
    assert ledgers.template_url == f"sqlite+aiosqlite:///{tmp_path / 'template.sqlite3'}"
