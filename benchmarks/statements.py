"""One hot write (marking a stored result submitted, with its audit event: one statement on
PostgreSQL) three ways in the same run: through the store as every call does (a connection
from SQLAlchemy's pool per write, the statement prepared on its psycopg connection:
``store.prepared``), SQLAlchemy Core executing the same statement on a connection held
throughout, and psycopg directly on a connection of its own, prepared. What each layer costs
per statement (issue 17: "measure SQLAlchemy Core against psycopg directly")."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import psycopg
from sqlalchemy.dialects import postgresql

from benchmarks.audit import libpq_url
from benchmarks.ledger_path import fresh_ledger
from benchmarks.report import Figure
from toolledger.domain.keys import CallKey
from toolledger.domain.results import succeeded
from toolledger.domain.states import SUBMIT, EffectClass
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.ledger_postgres import PostgresLedger
from toolledger.store.transitions import key_params

Progress = Callable[[str], None]
REASON = "result accepted"


async def run(url: str, quick: bool, progress: Progress) -> list[Figure]:
    count = 100 if quick else 2000
    fresh_ledger(url)
    engine = create_engine(url)
    try:
        store = LedgerStore(engine, actor="bench")
        assert isinstance(store, PostgresLedger)
        keys = await _stored_results(store, 3 * count)
        through_store, held, direct = keys[:count], keys[count : 2 * count], keys[2 * count :]

        started = time.perf_counter()
        for key in through_store:
            await store.mark_submitted(key, reason=REASON)
        store_ms = (time.perf_counter() - started) / count * 1000

        sources = tuple(sorted(s.value for s in SUBMIT.sources))
        statement = store._build_change(SUBMIT, sources)

        def event(key: CallKey) -> dict[str, str | None]:
            # As the store's own write passes them (its keyed MAC: None without a trail key).
            mac = store._mac(key, SUBMIT.event, SUBMIT.target, REASON)
            return {**key_params(key), **store._event_params(REASON), "e_trail_mac": mac}

        async with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
            started = time.perf_counter()
            for key in held:
                (await conn.execute(statement, event(key))).first()
            held_ms = (time.perf_counter() - started) / count * 1000

        given = event(direct[0])
        dialect = postgresql.psycopg.dialect()  # type: ignore[no-untyped-call]
        expanded = statement.compile(dialect=dialect).construct_expanded_state(given)
        async with await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True) as raw:
            started = time.perf_counter()
            for key in direct:
                cursor = await raw.execute(
                    expanded.statement, {**expanded.parameters, **key_params(key)}, prepare=True
                )
                await cursor.fetchone()
            direct_ms = (time.perf_counter() - started) / count * 1000
    finally:
        await engine.dispose()
    progress(
        f"one write: {store_ms:.3f} ms through the store, {held_ms:.3f} ms SQLAlchemy on a held "
        f"connection, {direct_ms:.3f} ms psycopg prepared"
    )
    return [
        Figure(
            "statements",
            "a write through the store",
            "ms",
            store_ms,
            direct_ms,
            "psycopg prepared",
            "-",
            None,
        ),
        Figure(
            "statements",
            "SQLAlchemy Core, held connection",
            "ms",
            held_ms,
            direct_ms,
            "psycopg prepared",
            "-",
            None,
        ),
    ]


async def _stored_results(store: LedgerStore, count: int) -> list[CallKey]:
    run = uuid.uuid4().hex[:8]
    keys = []
    for number in range(count):
        key = CallKey(f"sess_{run}", "turn_1", f"call_{number}")
        recorded = await store.record(
            key, tool_name="noop", arguments={}, effect_class=EffectClass.AT_MOST_ONCE, lease_seconds=60
        )
        await store.complete(key, recorded.call.lease_token, succeeded(key, "ok"))
        keys.append(key)
    return keys
