"""The throwaway ledgers of a conformance check: one per run, each a copy of a template the
check migrates once, so that no run sees another's calls or effects.

SQLite (the default): files in the check's directory, copied from a template file.
PostgreSQL (``database_url``): databases made on that server beside the given one, each
``CREATE DATABASE ... TEMPLATE`` of a migrated template, and dropped when their run (or the
check) ends. A transactional tool's SQL then runs on the database it runs on in production:
its rollback on a crash is PostgreSQL's, not SQLite's.
"""

from __future__ import annotations

import itertools
import shutil
import threading
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType

import psycopg
from psycopg import sql
from sqlalchemy.engine import URL, make_url

from toolledger.settings import async_database_url
from toolledger.testing.workers import CheckError

DATABASE_PREFIX = "toolledger_check_"
"""Every database a check makes on PostgreSQL is named so (a check killed before it could
drop them leaves them behind: `SELECT datname FROM pg_database WHERE datname LIKE
'toolledger_check_%'`)."""
CONNECT_SECONDS = 10


class ThrowawayLedgers(ABC):
    """Where a check's ledgers live; closing releases what they hold."""

    @property
    @abstractmethod
    def template_url(self) -> str:
        """The ledger the check migrates once; every run's ledger starts as a copy of it."""

    @abstractmethod
    def fresh(self, directory: Path) -> str:
        """A new ledger for one run (``directory``: the run's own, for files and notes)."""

    @abstractmethod
    def discard(self, url: str) -> None:
        """The run is over: its ledger may go (unless the check keeps everything)."""

    @abstractmethod
    def close(self) -> None:
        """The check is over: release what is left."""

    def __enter__(self) -> ThrowawayLedgers:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def throwaway_ledgers(workdir: Path, database_url: str | None, *, keep: bool) -> ThrowawayLedgers:
    """SQLite files in ``workdir``, or databases on the PostgreSQL server of ``database_url``."""
    if database_url is None:
        return SqliteLedgers(workdir)
    try:
        url = make_url(async_database_url(database_url))
    except ValueError as error:
        raise CheckError(str(error), param="--database-url") from None
    if url.get_backend_name() != "postgresql":
        raise CheckError(
            "expected a PostgreSQL server to make the throwaway databases on; "
            "SQLite ledgers are the default (leave the option out for them)",
            param="--database-url",
        )
    return PostgresLedgers(url, keep=keep)


class SqliteLedgers(ThrowawayLedgers):
    """A file per run in the run's directory, removed with the check's directory (or kept)."""

    def __init__(self, workdir: Path) -> None:
        self._template = workdir / "template.sqlite3"
        for stale in (self._template, *self._companions(self._template)):
            stale.unlink(missing_ok=True)

    @property
    def template_url(self) -> str:
        return sqlite_url(self._template)

    def fresh(self, directory: Path) -> str:
        ledger = directory / "ledger.sqlite3"
        shutil.copyfile(self._template, ledger)
        wal, ledger_wal = self._companions(self._template)[0], self._companions(ledger)[0]
        if wal.exists():  # closed, so normally folded into the file; if not, it is part of it
            shutil.copyfile(wal, ledger_wal)
        return sqlite_url(ledger)

    def discard(self, url: str) -> None:
        """Files go with the check's directory."""

    def close(self) -> None:
        """Files go with the check's directory."""

    @staticmethod
    def _companions(path: Path) -> tuple[Path, Path]:
        return path.with_name(f"{path.name}-wal"), path.with_name(f"{path.name}-shm")


class PostgresLedgers(ThrowawayLedgers):
    """A database per run on the server of ``url``, made by the role in it (which needs the
    CREATEDB privilege); ``keep``: leave every database for a look afterwards."""

    def __init__(self, url: URL, *, keep: bool) -> None:
        self._url = url
        self._keep = keep
        self._prefix = f"{DATABASE_PREFIX}{uuid.uuid4().hex[:10]}"
        self._template = f"{self._prefix}_template"
        self._numbers = itertools.count(1)
        self._made: set[str] = set()
        # Copies of one template are made one at a time: PostgreSQL refuses to copy a
        # database while another session is connected to it, and a copy under way is one.
        self._lock = threading.Lock()
        self._execute(
            sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self._template)),
            doing="make a throwaway database",
        )
        self._made.add(self._template)

    @property
    def template_url(self) -> str:
        return self._database_url(self._template)

    def fresh(self, directory: Path) -> str:
        name = f"{self._prefix}_{next(self._numbers)}"
        with self._lock:
            self._execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(self._template)
                ),
                doing="copy the throwaway ledger",
            )
            self._made.add(name)
        (directory / "ledger.txt").write_text(f"PostgreSQL database {name}\n", encoding="utf-8")
        return self._database_url(name)

    def discard(self, url: str) -> None:
        name = make_url(url).database
        if not self._keep and name in self._made:
            self._drop(name)

    def close(self) -> None:
        if self._keep:
            return
        for name in sorted(self._made):
            self._drop(name)

    def _drop(self, name: str) -> None:
        # FORCE: a SIGKILLed worker's session may not be gone yet.
        self._execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)),
            doing="drop a throwaway database",
        )
        self._made.discard(name)

    def _database_url(self, name: str) -> str:
        return self._url.set(database=name).render_as_string(hide_password=False)

    def _execute(self, statement: sql.Composed, *, doing: str) -> None:
        libpq = self._url.set(drivername="postgresql").render_as_string(hide_password=False)
        try:
            with psycopg.connect(libpq, autocommit=True, connect_timeout=CONNECT_SECONDS) as connection:
                connection.execute(statement)
        except psycopg.Error as error:
            # The server's own words, and the URL without its password.
            said = (str(error).strip().splitlines() or [type(error).__name__])[0]
            if isinstance(error, psycopg.errors.InsufficientPrivilege):
                role = self._url.username or "<role>"
                said += f" (the role needs CREATEDB: ALTER ROLE {role} CREATEDB)"
            where = self._url.render_as_string(hide_password=True)
            raise CheckError(f"could not {doing} on {where}: {said}") from None


def sqlite_url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"
