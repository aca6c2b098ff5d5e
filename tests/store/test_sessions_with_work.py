"""Which sessions a restarted `serve` reconciles first (``SessionStore.with_work``), on real
SQLite and PostgreSQL: those with an open call it can move on, not those whose only open calls
are at_most_once calls left `unknown` for an operator."""

from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.domain.keys import CallKey
from toolledger.domain.results import succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.store.ledger import LedgerStore
from toolledger.store.sessions import SessionStore

SHORT_LEASE = 0.05


async def _unknown(store: LedgerStore, key: CallKey, effect: EffectClass) -> None:
    """Claimed, then its lease ran out without a result: as a crash mid-handler leaves it."""
    await store.record(key, tool_name="t", arguments={}, effect_class=effect, lease_seconds=SHORT_LEASE)
    await asyncio.sleep(SHORT_LEASE * 4)
    [expired] = await store.expire_leases(key)
    assert expired.status is CallStatus.UNKNOWN


async def test_with_work__leaves_out_sessions_waiting_only_for_an_operator(engine: AsyncEngine) -> None:
    store = LedgerStore(engine, actor="worker")
    operator_only = CallKey("sess_operator_only", "turn_1", "call_1")
    await _unknown(store, operator_only, EffectClass.AT_MOST_ONCE)
    rerun = CallKey("sess_rerun", "turn_1", "call_1")
    await _unknown(store, rerun, EffectClass.IDEMPOTENT)
    mixed = CallKey("sess_mixed", "turn_1", "call_1")
    await _unknown(store, mixed, EffectClass.AT_MOST_ONCE)
    stored = CallKey("sess_mixed", "turn_1", "call_2")
    recorded = await store.record(
        stored, tool_name="t", arguments={}, effect_class=EffectClass.AT_MOST_ONCE, lease_seconds=30
    )
    await store.complete(stored, recorded.call.lease_token, succeeded(stored, "ok"))
    running = CallKey("sess_running", "turn_1", "call_1")
    await store.record(
        running, tool_name="t", arguments={}, effect_class=EffectClass.AT_MOST_ONCE, lease_seconds=30
    )

    sessions = SessionStore(engine)

    assert sorted(await sessions.with_work()) == ["sess_mixed", "sess_rerun", "sess_running"]
    assert "sess_operator_only" in await sessions.with_open_calls(), "still open: recovery watches it"
