"""A reconcile's end noted on its session (``SessionStore.mark_polled``), on real SQLite and
PostgreSQL: when, the status it read and the last event seen."""

from __future__ import annotations

import asyncio

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.store.schema import sessions
from toolledger.store.sessions import SessionStore


async def test_a_session_polled__noted_with_its_status_and_last_event(engine: AsyncEngine) -> None:
    store = SessionStore(engine)
    await store.watch_new(["sess_alone"])

    await asyncio.wait_for(store.mark_polled("sess_alone", status="idle", last_event_id="evt_9"), 5)

    async with engine.connect() as conn:
        row = (await conn.execute(select(sessions).where(sessions.c.session_id == "sess_alone"))).one()
    assert (row.status, row.last_event_id, row.last_polled_at is not None) == ("idle", "evt_9", True)
