"""The alert sender's cursor and lease (``alert_cursors``) and its reads of the audit trail,
on real SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.domain.alerts import AlertKind
from toolledger.domain.keys import CallKey
from toolledger.domain.redaction import Redactor
from toolledger.domain.states import EffectClass
from toolledger.store.alerts import AlertLease, AlertNote, AlertStore
from toolledger.store.audit import AuditStore
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import tool_call_events


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url)
    yield engine
    await engine.dispose()


def alert_store(engine: AsyncEngine) -> AlertStore:
    return AlertStore(engine, destination="webhook", actor="alerts:test", redactor=Redactor())


async def running_call(
    engine: AsyncEngine, name: str, lease_seconds: float = 30.0
) -> tuple[LedgerStore, CallKey]:
    store = LedgerStore(engine, actor="worker-1")
    key = CallKey("sess_alerts", "turn_1", name)
    await store.record(
        key,
        tool_name="charge",
        arguments={"cents": 1},
        effect_class=EffectClass.AT_MOST_ONCE,
        lease_seconds=lease_seconds,
    )
    return store, key


async def newest_event(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(select(func.max(tool_call_events.c.id)))).scalar_one() or 0)


async def test_lease__one_holder_at_a_time__taken_over_once_it_runs_out_and_the_old_holder_is_fenced(
    engine: AsyncEngine,
) -> None:
    alerts = alert_store(engine)
    await alerts.ensure_cursor()
    first = await alerts.take_lease("replica-a", 0.3)
    assert first is not None
    assert await alerts.take_lease("replica-b", 0.3) is None
    renewed = await alerts.take_lease("replica-a", 0.3)
    assert renewed == first, "renewed by its holder: same token, same cursor"

    await asyncio.sleep(0.5)
    taken = await alerts.take_lease("replica-b", 30.0)
    assert taken is not None
    assert taken.token == first.token + 1

    _, key = await running_call(engine, "call_fenced")
    note = AlertNote(key, "alert_sent", "unknown alert delivered", "alert tla_x of event 1")
    assert not await alerts.renew("replica-a", first.token, 30.0)
    assert not await alerts.advance("replica-a", first.token, expected=first.cursor, to=first.cursor + 1)
    assert not await alerts.record("replica-a", first.token, note, cursor=(first.cursor, first.cursor + 1))
    assert "alert_sent" not in [e.kind for e in await LedgerStore(engine, actor="t").events(key)]
    assert await alerts.record("replica-b", taken.token, note, cursor=(taken.cursor, taken.cursor + 1))
    assert await alerts.cursor() == AlertLease(taken.token, taken.cursor + 1)
    [sent] = [e for e in await LedgerStore(engine, actor="t").events(key) if e.kind == "alert_sent"]
    assert (sent.actor, sent.reason) == ("alerts:test", "unknown alert delivered")

    await alerts.release("replica-b")
    assert await alerts.take_lease("replica-a", 30.0) is not None, "given back: taken at once"


async def test_ensure_cursor__starts_at_the_end_of_the_trail__then_stays_where_it_is(
    engine: AsyncEngine,
) -> None:
    store, key = await running_call(engine, "call_before")
    await store.flag(key, "unconfirmed", "accepted 5 times but still in required_actions")
    alerts = alert_store(engine)
    await alerts.ensure_cursor()
    start = await alerts.cursor()
    assert start is not None
    assert start.cursor == await newest_event(engine), "the ledger's past raises no alert"
    window = await alerts.window(start.cursor, limit=100)
    assert (window.events, window.subjects) == (0, [])

    await store.flag(key, "unconfirmed", "accepted 5 times but still in required_actions")
    await alerts.ensure_cursor()
    assert await alerts.cursor() == start
    window = await alerts.window(start.cursor, limit=100)
    assert [s.kind for s in window.subjects] == [AlertKind.UNCONFIRMED]


async def test_window__only_events_that_raise_alerts__with_the_ids_missing_in_between(
    engine: AsyncEngine,
) -> None:
    alerts = alert_store(engine)
    await alerts.ensure_cursor()
    start = await newest_event(engine)
    store, key = await running_call(engine, "call_window", lease_seconds=0.05)
    await asyncio.sleep(0.1)
    await store.expire_leases(key)
    await store.flag(key, "unconfirmed", "accepted 5 times but still in required_actions")
    top = await newest_event(engine)
    async with engine.begin() as conn:  # an id that will never show: the record's event, gone
        await conn.execute(delete(tool_call_events).where(tool_call_events.c.id == start + 1))

    window = await alerts.window(start, limit=100)

    assert window.top == top
    assert window.missing == (start + 1,)
    assert [(s.kind, s.event.to_status) for s in window.subjects] == [
        (AlertKind.UNKNOWN, "unknown"),
        (AlertKind.UNCONFIRMED, None),
    ]
    unknown = window.subjects[0]
    assert (unknown.tool_name, unknown.status, unknown.attempts) == ("charge", "unknown", 1)
    assert unknown.call_id == key.idempotency_key
    limited = await alerts.window(start, limit=1)
    assert (limited.events, limited.top) == (1, start + 2)
    present, found = await alerts.among({start + 1, unknown.event.id})
    assert present == {unknown.event.id}
    assert [s.event.id for s in found] == [unknown.event.id]


async def test_prune__newest_events_deleted__a_sqlite_cursor_comes_down_so_ids_given_again_raise_alerts(
    engine: AsyncEngine,
) -> None:
    alerts = alert_store(engine)
    store, key = await running_call(engine, "call_pruned")
    await store.abandon(key, "the session stopped awaiting it")
    await alerts.ensure_cursor()
    before = await alerts.cursor()
    assert before is not None
    assert before.cursor == await newest_event(engine) > 0

    assert await AuditStore(engine).prune(datetime.now(UTC) + timedelta(days=1)) == 1
    after = await alerts.cursor()
    assert after is not None
    store, key = await running_call(engine, "call_after_prune", lease_seconds=0.05)
    await asyncio.sleep(0.1)
    await store.expire_leases(key)
    window = await alerts.window(after.cursor, limit=100)

    if engine.dialect.name == "sqlite":
        assert after.cursor == 0, "brought down to the newest event left (none)"
        assert await newest_event(engine) <= before.cursor, "SQLite gave the pruned ids again"
    else:
        assert after.cursor == before.cursor, "PostgreSQL's ids are never given again"
    assert [s.event.key for s in window.subjects] == [key], "the new call's alert is raised either way"
