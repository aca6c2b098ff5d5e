"""The PostgreSQL ledger's hot statements run prepared on psycopg under SQLAlchemy's pool: what
SQLAlchemy did per execution must still happen (column types converted both ways, errors
as SQLAlchemy's exceptions, a broken connection kept out of the pool, the caller's
transaction honoured)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC

import pytest
from sqlalchemy import bindparam, exc, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.domain.keys import CallKey
from toolledger.domain.states import EffectClass
from toolledger.store.engine import create_engine, is_transient
from toolledger.store.ledger import LedgerStore
from toolledger.store.prepared import PreparedStatement
from toolledger.store.schema import tool_calls


@pytest.fixture
async def tokyo_engine(postgres_url: str) -> AsyncIterator[AsyncEngine]:
    """One pooled connection, whose session time zone is not UTC."""
    engine = create_engine(
        postgres_url, pool_size=1, max_overflow=0, connect_args={"options": "-c TimeZone=Asia/Tokyo"}
    )
    try:
        yield engine
    finally:
        await engine.dispose()


def _key() -> CallKey:
    return CallKey("sess_prepared", "turn_1", f"call_{uuid.uuid4().hex[:8]}")


async def _record(store: LedgerStore, key: CallKey) -> None:
    await store.record(
        key, tool_name="noop", arguments={"a": 1}, effect_class=EffectClass.IDEMPOTENT, lease_seconds=30
    )


async def test_moments_come_back_in_utc_whatever_the_session_time_zone(tokyo_engine: AsyncEngine) -> None:
    store = LedgerStore(tokyo_engine, actor="worker")
    key = _key()
    recorded = await store.record(
        key, tool_name="noop", arguments={"a": 1}, effect_class=EffectClass.IDEMPOTENT, lease_seconds=30
    )
    created, expires = recorded.call.created_at, recorded.call.lease_expires_at
    assert created.tzinfo is UTC
    assert expires is not None
    assert expires.tzinfo is UTC
    read_back = await store.get(key)  # SQLAlchemy's own read path
    assert read_back is not None
    assert (read_back.created_at, read_back.lease_expires_at) == (created, expires)


async def test_a_connection_killed_under_the_ledger__transient_error__then_a_fresh_connection(
    tokyo_engine: AsyncEngine,
) -> None:
    store = LedgerStore(tokyo_engine, actor="worker", batching=False)
    key = _key()
    await _record(store, key)
    async with tokyo_engine.connect() as conn:  # the pool's only connection
        pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
    async with create_engine(str(tokyo_engine.url.render_as_string(hide_password=False))).connect() as admin:
        await admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})

    with pytest.raises(exc.DBAPIError) as raised:
        await store.abandon(key, "the session ended")
    assert is_transient(raised.value)
    assert raised.value.connection_invalidated
    abandoned = await store.abandon(key, "the session ended")  # a new connection, not the dead one
    assert abandoned is not None
    assert abandoned.status == "abandoned"


async def test_runs_in_the_callers_transaction(postgres_url: str) -> None:
    engine = create_engine(postgres_url)
    try:
        store = LedgerStore(engine, actor="worker")
        key = _key()
        await _record(store, key)
        rename = PreparedStatement(
            select(tool_calls.c.call_id).add_cte(
                tool_calls.update()
                .where(tool_calls.c.call_id == bindparam("k_call_id"))
                .values(tool_name="renamed")
                .returning(tool_calls.c.call_id)
                .cte("renamed")
            ),
            engine.dialect,
        )
        async with engine.connect() as conn:
            await conn.begin()
            assert await rename.rows(conn, {"k_call_id": key.call_id}) == [{"call_id": key.call_id}]
            await conn.rollback()
        unchanged = await store.get(key)
        assert unchanged is not None
        assert unchanged.tool_name == "noop"
    finally:
        await engine.dispose()


def test_a_statement_whose_text_would_vary_with_its_parameters_is_refused(postgres_url: str) -> None:
    dialect = create_engine(postgres_url).dialect
    varying = select(tool_calls.c.call_id).where(tool_calls.c.call_id.in_(bindparam("ids", expanding=True)))
    with pytest.raises(ValueError, match="expanding"):
        PreparedStatement(varying, dialect)
    constant = select(tool_calls.c.call_id).where(tool_calls.c.status.in_(["pending", "running"]))
    prepared = PreparedStatement(constant, dialect)
    assert "POSTCOMPILE" not in prepared.sql


def test_a_missing_parameter_is_named(postgres_url: str) -> None:
    prepared = PreparedStatement(
        select(tool_calls.c.call_id).where(tool_calls.c.call_id == bindparam("k_call_id")),
        create_engine(postgres_url).dialect,
    )
    with pytest.raises(exc.ArgumentError, match="k_call_id"):
        prepared.parameters({})
