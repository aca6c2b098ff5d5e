"""Side effects a transactional tool reports through the ledger's own transaction, during a
conformance check (``toolledger.testing.effect_in``).

The table lives only in the check's throwaway ledger, beside the ledger's tables but not in
their schema (no migration makes it): a row written through ``ctx.db`` commits with the
call's result or is rolled back with it, exactly as the tool's real writes are, so counting
the rows after a crash tells whether the tool's effect really was inside that transaction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, func, select
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

check_effects = Table(
    "toolledger_check_effects",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("name", String(200), nullable=False),
    Column("idempotency_key", String(255), nullable=True),
    Column("attempt", Integer, nullable=True),
    Column("pid", Integer, nullable=False),
)


async def create_table(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        await connection.run_sync(check_effects.metadata.create_all)


def is_async_connection(db: object) -> bool:
    return isinstance(db, AsyncConnection)


def write_effect(
    db: Connection | AsyncConnection, *, name: str, idempotency_key: str | None, attempt: int | None, pid: int
) -> Awaitable[Any] | None:
    """One row through ``db`` (a transactional tool's ``ctx.db``), inside its transaction: an
    awaitable to await for an ``AsyncConnection``, done at once for a ``Connection``."""
    statement = check_effects.insert().values(
        name=name, idempotency_key=idempotency_key, attempt=attempt, pid=pid
    )
    if isinstance(db, AsyncConnection):
        return db.execute(statement)
    if isinstance(db, Connection):
        db.execute(statement)
        return None
    raise TypeError(f"expected the ledger's connection (ctx.db), got {type(db).__name__}")


async def counts(engine: AsyncEngine) -> Counter[str]:
    """Committed rows by effect name."""
    async with engine.connect() as connection:
        rows = await connection.execute(
            select(check_effects.c.name, func.count()).group_by(check_effects.c.name)
        )
        return Counter({name: int(count) for name, count in rows})
