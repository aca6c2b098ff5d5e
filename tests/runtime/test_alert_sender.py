"""The alert sender over holes in the audit trail, on real PostgreSQL: an event whose
transaction commits after a later one was already visible still raises its alert, in order
when it commits within the sender's patience, late (and once) when it commits after."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.alert_receiver import AlertReceiver
from tests.support.polling import eventually
from toolledger.domain.keys import CallKey
from toolledger.domain.redaction import Redactor
from toolledger.domain.states import EffectClass
from toolledger.runtime.alert_sender import AlertSender
from toolledger.store.alerts import AlertStore
from toolledger.store.engine import create_engine, utc_now
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import tool_call_events

PATIENCE = 0.5


@asynccontextmanager
async def sending(engine: AsyncEngine, url: str) -> AsyncIterator[AlertSender]:
    store = AlertStore(engine, destination="webhook", actor="alerts:test", redactor=Redactor())
    await store.ensure_cursor()
    sender = AlertSender(
        store,
        url=url,
        secret="whsec-sender-test-0123456789",  # noqa: S106 - a test's signing key
        owner="replica-test",
        redactor=Redactor(),
        poll_seconds=0.05,
        gap_patience_seconds=PATIENCE,
    )
    task = asyncio.create_task(sender.run())
    try:
        yield sender
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        await sender.close()


async def two_calls(engine: AsyncEngine) -> tuple[LedgerStore, CallKey, CallKey]:
    store = LedgerStore(engine, actor="worker-1")
    keys = CallKey("sess_gap", "turn_1", "call_slow"), CallKey("sess_gap", "turn_1", "call_quick")
    for key in keys:
        await store.record(
            key,
            tool_name="charge",
            arguments={"cents": 1},
            effect_class=EffectClass.AT_MOST_ONCE,
            lease_seconds=30,
        )
    return store, *keys


def unknown_event(key: CallKey) -> dict[str, object]:
    """What the lease expiry of a call writes, in a transaction of the test's own."""
    return {
        "session_id": key.session_id,
        "turn_id": key.turn_id,
        "call_id": key.call_id,
        "at": utc_now(),
        "actor": "worker-2",
        "kind": "transition",
        "from_status": "running",
        "to_status": "unknown",
        "lease_token": 1,
        "reason": "lease of worker-1 expired without a result",
    }


async def test_sender__an_earlier_event_commits_within_patience__alerts_in_the_trail_order(
    postgres_url: str,
) -> None:
    engine = create_engine(postgres_url)
    try:
        store, slow, quick = await two_calls(engine)
        with AlertReceiver() as receiver:
            async with sending(engine, receiver.url), engine.connect() as open_transaction:
                await open_transaction.begin()
                await open_transaction.execute(insert(tool_call_events).values(**unknown_event(slow)))
                await store.flag(quick, "unconfirmed", "accepted 5 times but still in required_actions")
                await asyncio.sleep(PATIENCE / 3)
                assert receiver.alerts() == [], "the later event waits for the hole before it"
                await open_transaction.commit()
                alerts = await eventually(lambda: receiver.alerts() if len(receiver.alerts()) == 2 else None)
                await asyncio.sleep(PATIENCE * 2)
    finally:
        await engine.dispose()

    assert [(a.json["kind"], a.json["call"]["call_id"]) for a in alerts] == [
        ("unknown", "call_slow"),
        ("unconfirmed", "call_quick"),
    ]
    assert len(receiver.alerts()) == 2


async def test_sender__an_earlier_event_commits_after_patience__its_alert_is_sent_late_and_once(
    postgres_url: str,
) -> None:
    engine = create_engine(postgres_url)
    try:
        store, slow, quick = await two_calls(engine)
        with AlertReceiver() as receiver:
            async with sending(engine, receiver.url), engine.connect() as open_transaction:
                await open_transaction.begin()
                await open_transaction.execute(insert(tool_call_events).values(**unknown_event(slow)))
                await store.flag(quick, "unconfirmed", "accepted 5 times but still in required_actions")
                [first] = await eventually(lambda: receiver.alerts(), within=PATIENCE * 10)
                await open_transaction.commit()
                alerts = await eventually(lambda: receiver.alerts() if len(receiver.alerts()) == 2 else None)
                await asyncio.sleep(PATIENCE * 2)
            trail = await LedgerStore(engine, actor="t").events(slow)
    finally:
        await engine.dispose()

    assert (first.json["kind"], first.json["call"]["call_id"]) == ("unconfirmed", "call_quick")
    assert (alerts[1].json["kind"], alerts[1].json["call"]["call_id"]) == ("unknown", "call_slow")
    assert len(receiver.alerts()) == 2, "each once"
    assert [e.reason for e in trail if e.kind == "alert_sent"] == [
        "unknown alert delivered (HTTP 204, 1 try)"
    ]
