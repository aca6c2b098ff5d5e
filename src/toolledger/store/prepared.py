"""The ledger's hot statements on PostgreSQL, run as prepared statements on the psycopg
connection under a pooled SQLAlchemy one.

SQLAlchemy builds each statement (the schema, the transitions and their events are declared
once, there) and its pool lends the connection; psycopg runs the compiled text, prepared on
the server the first time each connection sees it. Measured on one write
(``python -m benchmarks --only statements``): SQLAlchemy's execution of a cached statement
cost about as much client CPU as PostgreSQL spent running it, and the ledger's writes are
what ``serve`` spends its one core on. What SQLAlchemy does per execution that still matters
is kept: the column types' conversions both ways (``StorableText``, ``UtcDateTime``), errors
raised as SQLAlchemy's own exceptions (``store.engine.is_transient`` reads them), and a
broken connection invalidated so the pool does not lend it again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from sqlalchemy import exc
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement, SelectBase

Processor = Callable[[Any], Any]


class PreparedStatement:
    """One SQLAlchemy statement compiled once for psycopg: its text, its constant parameters
    and the conversions of its parameters and result columns."""

    def __init__(self, statement: ClauseElement, dialect: Dialect) -> None:
        compiled = statement.compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler)
        given = {name for bind, name in compiled.bind_names.items() if bind.required}
        if compiled.escaped_bind_names or any(b.expanding and b.required for b in compiled.bind_names):
            # The text would change with the parameters: nothing to prepare once.
            raise ValueError("a prepared statement takes neither expanding nor escaped parameters")
        # Constant lists (``IN`` a tuple of states) are written into the text, once.
        expanded = compiled.construct_expanded_state(dict.fromkeys(given))
        self.sql = expanded.statement
        self.required = frozenset(given)
        self._binds: dict[str, Processor] = dict(expanded.processors)  # the expanded lists' own
        for bind, name in compiled.bind_names.items():
            processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if processor is not None and not bind.expanding:
                self._binds[name] = processor
        self.constants = {
            name: self._bound(name, value) for name, value in expanded.parameters.items() if name not in given
        }
        if not isinstance(statement, SelectBase):
            raise ValueError("a prepared statement returns rows: a SELECT (writes in its CTEs)")
        columns = list(statement.selected_columns)
        # Rows come back as tuples and are named here: psycopg's named rows build a
        # description of every column on every execution (a tenth of a write's CPU).
        self.names = tuple(str(column.key) for column in columns)
        self._results: dict[str, Processor] = {}
        for column in columns:
            processor = column.type.dialect_impl(dialect).result_processor(dialect, None)
            if processor is not None:
                self._results[str(column.key)] = processor

    def parameters(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The statement's constants and ``given``, converted as their column types say."""
        missing = self.required - given.keys()
        if missing:
            raise exc.ArgumentError(f"no value for the statement's parameters {sorted(missing)}")
        values = dict(self.constants)
        for name, value in given.items():
            values[name] = self._bound(name, value)
        return values

    def row(self, values: tuple[Any, ...]) -> dict[str, Any]:
        row = dict(zip(self.names, values, strict=True))
        for name, processor in self._results.items():
            row[name] = processor(row[name])
        return row

    def _bound(self, name: str, value: Any) -> Any:
        processor = self._binds.get(name)
        return value if processor is None or value is None else processor(value)

    async def rows(self, conn: AsyncConnection, given: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Run on ``conn``'s psycopg connection (in its transaction, if it has one begun) and
        return the rows as mappings of column name to value."""
        driver: Any = (await conn.get_raw_connection()).driver_connection  # psycopg's AsyncConnection
        try:
            cursor = await driver.execute(self.sql, self.parameters(given), prepare=True)
            raw = await cursor.fetchall()
        except psycopg.Error as error:
            broken = driver.broken or driver.closed
            if broken:
                await conn.invalidate(error)
            raise exc.DBAPIError.instance(
                self.sql,
                None,
                error,
                psycopg.Error,
                hide_parameters=True,
                connection_invalidated=broken,
                dialect=conn.dialect,
            ) from error
        return [self.row(r) for r in raw]


__all__ = ["PreparedStatement"]
