"""A reconcile's end noted on its session (``SessionStore.mark_polled``), on real SQLite and
PostgreSQL: sessions reconciled at the same moment (a thousand after a restart) are noted by
one write, each with the status its own reconcile read."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.store.schema import sessions
from toolledger.store.sessions import SessionStore


async def _polled(engine: AsyncEngine) -> dict[str, tuple[str | None, bool]]:
    async with engine.connect() as conn:
        rows = await conn.execute(select(sessions.c.session_id, sessions.c.status, sessions.c.last_polled_at))
        return {row.session_id: (row.status, row.last_polled_at is not None) for row in rows}


async def test_sessions_polled_together__noted_by_one_statement_per_status(engine: AsyncEngine) -> None:
    store = SessionStore(engine)
    ids = [f"sess_poll_{n}" for n in range(6)]
    await store.watch_new([*ids, "sess_not_polled"])
    updates: list[str] = []

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE SESSIONS"):
            updates.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", on_execute)
    try:
        await asyncio.gather(
            *(store.mark_polled(s, status="idle" if n % 2 else "requires_action") for n, s in enumerate(ids))
        )
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", on_execute)

    assert len(updates) == 2  # one per status read, for the six sessions
    polled = await _polled(engine)
    assert {s: polled[s] for s in ids} == {
        s: ("idle" if n % 2 else "requires_action", True) for n, s in enumerate(ids)
    }
    assert polled["sess_not_polled"] == (None, False)


async def test_a_session_polled_alone__noted_at_once(engine: AsyncEngine) -> None:
    store = SessionStore(engine)
    await store.watch_new(["sess_alone"])

    await asyncio.wait_for(store.mark_polled("sess_alone", status="idle", last_event_id="evt_9"), 5)

    async with engine.connect() as conn:
        row = (await conn.execute(select(sessions).where(sessions.c.session_id == "sess_alone"))).one()
    assert (row.status, row.last_event_id, row.last_polled_at is not None) == ("idle", "evt_9", True)
