"""AuditStore's pruning, on a real SQLite file and a real PostgreSQL database: a call is
deleted with its whole audit trail, or kept with its whole audit trail, never in between."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.domain.keys import CallKey
from toolledger.domain.results import succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.store.audit import AuditStore
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import tool_calls
from toolledger.store.transitions import KEY_MATCH, key_params

PRUNE_BEFORE = datetime.now(UTC) + timedelta(days=1)
"""Every call these tests finish was last changed before it."""


async def submitted_call(store: LedgerStore) -> CallKey:
    key = CallKey("sess_prune", f"turn_{uuid.uuid4().hex[:8]}", f"call_{uuid.uuid4().hex[:8]}")
    await store.record(
        key, tool_name="send", arguments={}, effect_class=EffectClass.IDEMPOTENT, lease_seconds=30.0
    )
    await store.complete(key, 1, succeeded(key, "sent"))
    assert await store.mark_submitted(key) is not None
    return key


@contextmanager
def changed_after_the_prune_picks_its_calls(engine: AsyncEngine, key: CallKey) -> Iterator[list[str]]:
    """Right after the prune's first statement (the one that picks the calls to delete), the
    call ``key`` changes, on the prune's own connection, so deterministically between its
    statements: as a resubmission would (a new ``updated_at``), it is no longer prunable."""
    done: list[str] = []

    def change_once(conn: Connection, _cursor: Any, statement: str, *_: Any) -> None:
        if done or not statement.lstrip().upper().startswith("SELECT"):
            return
        done.append(statement)
        conn.execute(
            tool_calls.update().where(KEY_MATCH).values(updated_at=PRUNE_BEFORE + timedelta(days=1)),
            key_params(key),
        )

    event.listen(engine.sync_engine, "after_cursor_execute", change_once)
    try:
        yield done
    finally:
        event.remove(engine.sync_engine, "after_cursor_execute", change_once)


async def test_prune__a_call_changed_meanwhile_is_kept_with_its_whole_trail(engine: AsyncEngine) -> None:
    store = LedgerStore(engine, actor="worker")
    kept, pruned = await submitted_call(store), await submitted_call(store)
    trail = await store.events(kept)
    assert len(trail) == 3

    with changed_after_the_prune_picks_its_calls(engine, kept) as changed:
        removed = await AuditStore(engine).prune(PRUNE_BEFORE)

    assert changed, "the prune's statements were not seen"
    assert removed == 1
    assert await store.get(pruned) is None
    assert await store.events(pruned) == []
    still = await store.get(kept)
    assert still is not None
    assert still.status is CallStatus.SUBMITTED
    assert await store.events(kept) == trail


async def test_prune__deletes_finished_calls_with_their_trails_and_keeps_open_ones(
    engine: AsyncEngine,
) -> None:
    store = LedgerStore(engine, actor="worker")
    finished = [await submitted_call(store) for _ in range(3)]
    running = CallKey("sess_prune", "turn_open", "call_open")
    await store.record(
        running, tool_name="send", arguments={}, effect_class=EffectClass.IDEMPOTENT, lease_seconds=30.0
    )
    seen: list[int] = []

    removed = await AuditStore(engine).prune(PRUNE_BEFORE, batch=2, progress=seen.append)

    assert removed == 3
    assert seen == [2, 3]
    for key in finished:
        assert await store.get(key) is None
        assert await store.events(key) == []
    assert len(await store.events(running)) == 1
    async with engine.connect() as conn:
        assert (await conn.execute(select(tool_calls.c.call_id))).scalars().all() == ["call_open"]


async def test_prune__a_dry_run_counts_and_deletes_nothing(engine: AsyncEngine) -> None:
    store = LedgerStore(engine, actor="worker")
    key = await submitted_call(store)

    assert await AuditStore(engine).prune(PRUNE_BEFORE, dry_run=True) == 1
    assert await store.get(key) is not None
    assert len(await store.events(key)) == 3
