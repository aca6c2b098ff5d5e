"""Engines for the two supported databases, and the database clock leases are measured on."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

from sqlalchemy import Float, event, exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql import expression
from sqlalchemy.sql.compiler import SQLCompiler

from toolledger.domain.trail import CONTENT_FIELDS
from toolledger.store.chain import (
    SQLITE_CONTENT_FUNCTION,
    SQLITE_FUNCTION,
    sqlite_content_sha256,
    sqlite_event_sha256,
)
from toolledger.store.schema import UtcDateTime

SQLITE_BUSY_TIMEOUT_MS = 30_000


def create_engine(url: str, **options: Any) -> AsyncEngine:
    """An async engine; SQLite gets a durable WAL set-up, PostgreSQL a small pool."""
    parsed = make_url(url)
    # A statement's parameters are tool arguments and outputs: kept out of every error text
    # SQLAlchemy builds (and so out of logs and of what an operator is shown).
    options.setdefault("hide_parameters", True)
    if parsed.get_backend_name() == "sqlite":
        engine = create_async_engine(url, **options)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        event.listen(engine.sync_engine, "connect", _sqlite_functions)
        return engine
    # No pre-ping: it cost a round trip per checkout, and every ledger write is a checkout
    # (a tenth of serve's CPU in a profile). A connection broken by a database restart fails
    # its one statement, SQLAlchemy then discards the whole pool, and that statement is
    # retried or left to the reconciler like any transient error (tests/chaos/
    # test_database_outages.py restarts PostgreSQL under load).
    options.setdefault("pool_pre_ping", False)
    # Small by default: PostgreSQL allows 100 connections, shared by every replica and tool.
    options.setdefault("pool_size", 5)
    options.setdefault("max_overflow", 5)
    return create_async_engine(url, **options)


_SQLITE_WRITERS: WeakKeyDictionary[Engine, asyncio.Lock] = WeakKeyDictionary()


def write_lock(engine: AsyncEngine) -> AbstractAsyncContextManager[Any]:
    """Held around every write transaction of this process on a SQLite ledger.

    SQLite lets one writer in at a time and makes the others retry in its busy handler,
    which sleeps (up to 100 ms a try) instead of queueing: with a few dozen calls in flight
    most of the time went to those sleeps. Queued here, the writers of one process take
    turns at once; PostgreSQL needs no such thing.
    """
    if engine.dialect.name != "sqlite":
        return nullcontext()
    return _SQLITE_WRITERS.setdefault(engine.sync_engine, asyncio.Lock())


@asynccontextmanager
async def write_transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """``engine.begin()``, queued behind this process's other SQLite writers (``write_lock``)."""
    async with write_lock(engine), engine.begin() as conn:
        yield conn


_AUTOCOMMIT: WeakKeyDictionary[Engine, AsyncEngine] = WeakKeyDictionary()


def autocommit(engine: AsyncEngine) -> AsyncEngine:
    """The same pool, each statement committing by itself: on PostgreSQL, a single statement
    without the BEGIN and COMMIT round trips (or, for a read, the ROLLBACK when its connection
    goes back to the pool)."""
    found = _AUTOCOMMIT.get(engine.sync_engine)
    if found is None:
        found = _AUTOCOMMIT[engine.sync_engine] = engine.execution_options(isolation_level="AUTOCOMMIT")
    return found


def single_write(engine: AsyncEngine) -> AbstractAsyncContextManager[AsyncConnection]:
    """A connection for one write statement: in autocommit on PostgreSQL; on SQLite a write
    transaction, queued behind the process's other writers (``write_transaction``)."""
    if engine.dialect.name == "sqlite":
        return write_transaction(engine)
    return autocommit(engine).connect()


_T = TypeVar("_T")
_Store = TypeVar("_Store", bound=type)


async def run_to_completion(operation: Coroutine[Any, Any, _T]) -> _T:
    """Runs ``operation`` to its end even if the caller is cancelled meanwhile; the caller's
    cancellation is delivered once it has finished.

    Why, on SQLite: a cancellation landing mid-statement makes SQLAlchemy terminate the
    aiosqlite connection, and when a second cancellation interrupts that (a task cancelled
    directly and through the task awaiting it, as at shutdown), aiosqlite (0.22) forgets the
    connection without closing it: its open transaction keeps the file's write lock until
    the garbage collector finds it, and every other writer waits out the busy timeout (CI:
    `serve` taking 30 s to stop, "database is locked"). A statement that finishes first
    ends its transaction normally.
    """
    task = asyncio.ensure_future(operation)
    cancelled = False
    while not task.done():
        try:
            # wait() neither cancels the task nor raises its error: both are settled below.
            await asyncio.wait([task])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not task.cancelled():
            task.exception()  # seen: the caller's cancellation is what it gets
        raise asyncio.CancelledError
    return task.result()


async def finished_on_sqlite(engine: AsyncEngine, operation: Coroutine[Any, Any, _T]) -> _T:
    """``operation`` on this engine, run to completion on SQLite (``run_to_completion``)."""
    if engine.dialect.name != "sqlite":
        return await operation
    return await run_to_completion(operation)


def uninterrupted_on_sqlite(store: _Store) -> _Store:
    """Class decorator for a store (anything with an ``engine``): on SQLite each public
    coroutine method runs to completion despite cancellation (see ``run_to_completion``).
    PostgreSQL needs no such thing: a cancelled statement's connection is closed cleanly and
    the server rolls back; the task per call it costs is kept off that path."""
    return _wrap_public_coroutines(store, _uninterrupted)


def uninterrupted(store: _Store) -> _Store:
    """Class decorator for a SQLite store: each public coroutine method, its own or inherited,
    runs to completion despite cancellation (see ``run_to_completion``)."""
    return _wrap_public_coroutines(store, _to_completion)


_Method = Callable[..., Coroutine[Any, Any, Any]]


def _wrap_public_coroutines(store: _Store, wrap: Callable[[_Method], _Method]) -> _Store:
    """Every public coroutine method of ``store``, its own or inherited, through ``wrap``."""
    for name in dir(store):
        member = getattr(store, name)
        if not name.startswith("_") and inspect.iscoroutinefunction(member):
            setattr(store, name, wrap(member))
    return store


def _to_completion(method: _Method) -> _Method:
    @functools.wraps(method)
    async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await run_to_completion(method(self, *args, **kwargs))

    return run


def _uninterrupted(method: _Method) -> _Method:
    @functools.wraps(method)
    async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await finished_on_sqlite(self.engine, method(self, *args, **kwargs))

    return run


def is_transient(error: BaseException) -> bool:
    """The database is away for a moment (restarting, unreachable, SQLite locked too long):
    the same statement may succeed if tried again."""
    if isinstance(error, (exc.OperationalError, exc.InterfaceError)):
        return True
    if isinstance(error, exc.TimeoutError):
        # Every pooled connection stayed busy past the pool's timeout: a burst of work, not
        # a broken database. Dropping an outcome write for it would strand a stored result.
        return True
    return isinstance(error, exc.DBAPIError) and error.connection_invalidated


def sync_url(url: str) -> str:
    """The same database through a synchronous driver (for Alembic)."""
    parsed = make_url(url)
    if parsed.drivername == "sqlite+aiosqlite":
        parsed = parsed.set(drivername="sqlite")
    return parsed.render_as_string(hide_password=False)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL with synchronous=FULL: a committed transition survives power loss, readers never block.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.close()


SQLITE_LOWER = "toolledger_lower"
"""SQLite's name for ``lower_like_postgresql``: its own lower() folds ASCII letters only."""


class _PerCharacterLower(dict[int, str]):
    """A ``str.translate`` table filled as characters are met."""

    def __missing__(self, code: int) -> str:
        lowered = chr(code).lower()
        # One character for one, as PostgreSQL maps them: İ (the one letter whose lowercase
        # is two characters, i and a combining dot) becomes i.
        self[code] = lowered if len(lowered) == 1 else lowered[0]
        return self[code]


_LOWER = _PerCharacterLower()


def lower_like_postgresql(text: Any) -> Any:
    """lower() as PostgreSQL computes it in a UTF-8 database: each character on its own,
    by Unicode's tables (Python's ``str.lower`` looks at context: a final Σ becomes ς), so
    that a search matches the same calls on SQLite as on PostgreSQL."""
    if not isinstance(text, str):
        return text
    return text.lower() if text.isascii() else text.translate(_LOWER)


def _sqlite_functions(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.create_function(SQLITE_LOWER, 1, lower_like_postgresql, deterministic=True)
    # The trail's trigger calls it for every event inserted (store.chain): with the fields of
    # FIELDS_V2, or of FIELDS (migration 0008's trigger, until 0010 replaces it).
    dbapi_connection.create_function(SQLITE_FUNCTION, -1, sqlite_event_sha256, deterministic=True)
    # Each event's INSERT computes the digest of its call's content (store.chain).
    dbapi_connection.create_function(
        SQLITE_CONTENT_FUNCTION, len(CONTENT_FIELDS), sqlite_content_sha256, deterministic=True
    )


def dialect_insert(engine: AsyncEngine) -> Callable[..., Any]:
    """The engine's database's own INSERT, which knows ON CONFLICT."""
    return postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert


class utc_now(expression.FunctionElement[datetime]):
    """The database's clock, so that workers with skewed clocks agree on lease expiry."""

    type = UtcDateTime()
    inherit_cache = True


class utc_after(expression.FunctionElement[datetime]):
    """The database's clock plus a number of seconds (a bound parameter)."""

    type = UtcDateTime()
    inherit_cache = True


# SQLite keeps timestamps as text in SQLAlchemy's format, 'YYYY-MM-DD HH:MM:SS.ffffff':
# strftime's %f gives SS.SSS, so three zeros complete the microseconds and the text sorts
# exactly like the times it spells.
_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f000', 'now')"


@compiles(utc_now, "postgresql")
def _pg_now(_element: utc_now, _compiler: SQLCompiler, **_kw: Any) -> str:
    return "clock_timestamp()"


@compiles(utc_now, "sqlite")
def _sqlite_now(_element: utc_now, _compiler: SQLCompiler, **_kw: Any) -> str:
    return _SQLITE_NOW


@compiles(utc_after, "postgresql")
def _pg_after(element: utc_after, compiler: SQLCompiler, **kw: Any) -> str:
    return f"clock_timestamp() + make_interval(secs => {compiler.process(element.clauses, **kw)})"


@compiles(utc_after, "sqlite")
def _sqlite_after(element: utc_after, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    # The number's own sign ('-3600 seconds', '30 seconds'): a '+' prefix made '+-3600
    # seconds', no modifier, and every time in the past NULL (a sweep never due again,
    # long-dead replicas' rows never cleaned up). NULL seconds stay a NULL time (no deadline).
    return f"strftime('%Y-%m-%d %H:%M:%f000', 'now', ({seconds}) || ' seconds')"


class seconds_until(expression.FunctionElement[float]):
    """Seconds from the database's clock until a timestamp column (negative once past)."""

    type = Float()
    inherit_cache = True


@compiles(seconds_until, "postgresql")
def _pg_seconds_until(element: seconds_until, compiler: SQLCompiler, **kw: Any) -> str:
    return f"extract(epoch from ({compiler.process(element.clauses, **kw)}) - clock_timestamp())"


@compiles(seconds_until, "sqlite")
def _sqlite_seconds_until(element: seconds_until, compiler: SQLCompiler, **kw: Any) -> str:
    moment = compiler.process(element.clauses, **kw)
    return f"(julianday({moment}) - julianday('now')) * 86400.0"


def missing_sqlite_file(url: str) -> str | None:
    """The path of a SQLite ledger file that does not exist (None if it exists or is not
    SQLite): opening it would create an empty file, and a mistyped path would look like a
    new, empty ledger."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return None if Path(parsed.database).exists() else parsed.database
