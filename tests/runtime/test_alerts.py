"""The alert webhook of `serve`, against a real HTTP receiver in a thread, on real SQLite and
PostgreSQL, with the emulator over HTTP and the real SDK: a signed alert when a call becomes
unknown, is flagged unconfirmed, or is given up; a receiver that is down at first, or that
hangs; a restart; two replicas."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from tests.support.alert_receiver import AlertReceiver, ReceivedAlert, free_port, receiver_url
from tests.support.executor_harness import FunctionCallAction, pending_actions
from tests.support.polling import eventually
from tests.support.serve_process import TOOLS, ServeProcess, run_cli
from tests.support.service_harness import running_service, service_settings
from tests.support.workload import start_sessions, wait_until_idle
from toolledger import verify_alert_signature
from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallEvent
from toolledger.domain.results import UNKNOWN_OUTCOME_MESSAGE
from toolledger.domain.states import EffectClass
from toolledger.emulator import EmulatorServer, Script
from toolledger.errors import ConfigurationError
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.service import Service
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import alert_cursors
from toolledger.store.sessions import SessionStore

SIGNING_KEY = "whsec-test-0123456789abcdefghijklmnop"
PUBLIC_URL = "https://ledger.example.com/"
CANARY = "CANARY-alert-argument-4e1f"


def alert_settings(url: str, **overrides: Any) -> dict[str, Any]:
    """Fast rounds of retries, so a receiver that is down is tried again within a test."""
    return {
        "alert_webhook_url": url,
        "alert_webhook_secret": SIGNING_KEY,
        "public_url": PUBLIC_URL,
        "alert_retry_max_seconds": 0.5,
        "alert_timeout_seconds": 2.0,
        **overrides,
    }


@asynccontextmanager
async def alerting_service(
    database_url: str, emulator: EmulatorServer, url: str, **overrides: Any
) -> AsyncIterator[Service]:
    async with running_service(database_url, emulator, **alert_settings(url, **overrides)) as service:
        yield service


async def cut_off(database_url: str, session_id: str, action: FunctionCallAction) -> CallKey:
    """The call as a worker that died inside its handler leaves it: recorded and claimed,
    under a lease that runs out without a result (real ledger writes, no shortcut)."""
    engine = create_engine(database_url)
    try:
        key = CallKey(session_id, action.turn_id, action.call_id)
        recorded = await LedgerStore(engine, actor="dead-worker").record(
            key,
            tool_name=action.name,
            arguments=action.arguments,
            effect_class=EffectClass.AT_MOST_ONCE,
            lease_seconds=0.2,
        )
        assert recorded.claimed
        return key
    finally:
        await engine.dispose()


async def timeline(database_url: str, key: CallKey) -> list[CallEvent]:
    engine = create_engine(database_url)
    try:
        return await LedgerStore(engine, actor="test").events(key)
    finally:
        await engine.dispose()


async def alerts_received(receiver: AlertReceiver, count: int, within: float = 20.0) -> list[ReceivedAlert]:
    return await eventually(
        lambda: receiver.alerts() if len(receiver.alerts()) >= count else None,
        within=within,
        what=lambda: f"{count} alert(s); received {[a.json['kind'] for a in receiver.alerts()]}",
    )


def assert_signed(alert: ReceivedAlert) -> None:
    assert verify_alert_signature(alert.body, alert.signature, SIGNING_KEY)
    assert not verify_alert_signature(alert.body, alert.signature, "another-secret-of-some-length")
    assert not verify_alert_signature(alert.body.replace(b'"kind"', b'"kinds"'), alert.signature, SIGNING_KEY)


async def test_alerts__call_becomes_unknown_then_is_given_up__two_signed_alerts_linking_its_page(
    database_url: str, emulator: EmulatorServer
) -> None:
    """hold_funds (at_most_once, unknown_deadline 2 s): the dead worker's lease runs out (an
    "unknown" alert), then recovery gives it up with a fixed failure (a "given_up" alert)."""
    arguments = {"cents": 5, "card_number": "4111 1111 1111 1111", "note": CANARY}
    session_id, [action] = await pending_actions(emulator, [("hold_funds", arguments)])
    key = await cut_off(database_url, session_id, action)
    with AlertReceiver() as receiver:
        async with alerting_service(database_url, emulator, receiver.url) as service:
            await service.watch(session_id)
            unknown, given_up = await alerts_received(receiver, 2)
            trail = await eventually(
                lambda: _with_kind(timeline(database_url, key), "alert_sent", 2), what="both deliveries noted"
            )

    for alert in (unknown, given_up):
        assert_signed(alert)
        assert alert.alert_id == alert.json["id"]
        assert alert.headers["content-type"] == "application/json"
        assert CANARY.encode() not in alert.body, "never the call's arguments"
        assert b"4111 1111" not in alert.body
        assert UNKNOWN_OUTCOME_MESSAGE.encode() not in alert.body, "never its result"
        assert alert.json["call"] | {"status": None} == {
            "id": key.idempotency_key,
            "session_id": session_id,
            "turn_id": action.turn_id,
            "call_id": action.call_id,
            "tool": "hold_funds",
            "effect_class": "at_most_once",
            "status": None,
            "attempts": 1,
        }
        assert alert.json["url"] == f"https://ledger.example.com/ui/#call={key.idempotency_key}"
    assert (unknown.json["kind"], unknown.json["call"]["status"]) == ("unknown", "unknown")
    assert "expired without a result" in unknown.json["reason"]
    assert (given_up.json["kind"], given_up.json["call"]["status"]) == ("given_up", "failed")
    assert given_up.json["reason"].startswith("unknown for more than 2s")
    assert unknown.json["event_id"] < given_up.json["event_id"]
    sent = [e for e in trail if e.kind == "alert_sent"]
    assert [e.reason for e in sent] == [
        "unknown alert delivered (HTTP 204, 1 try)",
        "given_up alert delivered (HTTP 204, 1 try)",
    ]
    assert sent[0].detail == f"alert {unknown.alert_id} of event {unknown.json['event_id']}"
    assert len(receiver.alerts()) == 2, "each alert once"


async def _with_kind(events: Any, kind: str, count: int) -> list[CallEvent] | None:
    trail: list[CallEvent] = await events
    return trail if sum(e.kind == kind for e in trail) >= count else None


async def test_alerts__call_flagged_unconfirmed__one_alert(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    """The session accepts the result but never consumes it: flagged once, alerted once."""
    [session_id] = await start_sessions(emulator, 1, Script.of_calls([("lookup", {"order_id": "A1"})]))
    emulator.control.accept_without_apply(session_id=session_id)
    with AlertReceiver() as receiver:
        async with alerting_service(
            database_url, emulator, receiver.url, resubmit_after_seconds=0.2, reconcile_interval_seconds=0.3
        ) as service:
            await service.watch(session_id)
            [alert] = await alerts_received(receiver, 1, within=30.0)
            await asyncio.sleep(1.5)  # more resubmissions: no second alert

    assert_signed(alert)
    assert alert.json["kind"] == "unconfirmed"
    assert alert.json["call"]["tool"] == "lookup"
    assert alert.json["call"]["status"] == "submitted"
    assert alert.json["reason"] == "accepted 5 times but still in required_actions"
    assert len(receiver.alerts()) == 1


async def test_alerts__receiver_down_at_first__alerts_arrive_in_order_once_it_is_up(
    database_url: str, emulator: EmulatorServer
) -> None:
    port = free_port()
    session_id, actions = await pending_actions(
        emulator, [("charge", {"amount": 1}), ("charge", {"amount": 2}), ("charge", {"amount": 3})]
    )
    keys = [await cut_off(database_url, session_id, action) for action in actions]
    async with alerting_service(database_url, emulator, receiver_url(port)) as service:
        await service.watch(session_id)
        # The first alert's round of tries failed, and its call's timeline says so.
        failed = await eventually(
            lambda: _failed_notes(database_url, keys), within=20.0, what="a failed round noted"
        )
        await asyncio.sleep(1.5)  # rounds go on failing meanwhile: nothing piles up in memory
        with AlertReceiver(port) as receiver:
            alerts = await alerts_received(receiver, 3)
            trail = await eventually(
                lambda: _with_kind(timeline(database_url, failed.key), "alert_sent", 1), what="delivery noted"
            )

    assert [a.json["kind"] for a in alerts] == ["unknown"] * 3
    event_ids = [a.json["event_id"] for a in alerts]
    assert event_ids == sorted(event_ids), "in the order of the audit trail"
    assert {a.json["call"]["call_id"] for a in alerts} == {k.call_id for k in keys}
    for alert in alerts:
        assert_signed(alert)
    assert len({a.alert_id for a in alerts}) == 3, "each once: the receiver was down, not slow"
    assert failed.reason is not None
    assert failed.reason.startswith("unknown alert not delivered: could not connect (3 tries so far)")
    kinds = [e.kind for e in trail if e.kind.startswith("alert_")]
    assert kinds[0] == "alert_failed"
    assert kinds[-1] == "alert_sent"
    assert kinds.count("alert_sent") == 1
    # Rounds 1, 2, 4, 8...: a few lines in the timeline however long the receiver is down.
    assert kinds.count("alert_failed") <= 4


async def _failed_notes(database_url: str, keys: list[CallKey]) -> CallEvent | None:
    for key in keys:
        for event in await timeline(database_url, key):
            if event.kind == "alert_failed":
                return event
    return None


async def test_alerts__service_restarted__delivered_alerts_are_not_sent_again(
    database_url: str, emulator: EmulatorServer
) -> None:
    before_id, [first] = await pending_actions(emulator, [("charge", {"amount": 1})])
    after_id, [second] = await pending_actions(emulator, [("charge", {"amount": 2})])
    with AlertReceiver() as receiver:
        first_key = await cut_off(database_url, before_id, first)
        async with alerting_service(database_url, emulator, receiver.url) as service:
            await service.watch(before_id)
            [before] = await alerts_received(receiver, 1)
            await eventually(lambda: _with_kind(timeline(database_url, first_key), "alert_sent", 1))

        second_key = await cut_off(database_url, after_id, second)
        async with alerting_service(database_url, emulator, receiver.url) as service:
            await service.watch(after_id)
            _, after = await alerts_received(receiver, 2)
            await asyncio.sleep(1.5)  # a few more reads of the trail

    assert before.json["call"]["call_id"] == first_key.call_id
    assert after.json["call"]["call_id"] == second_key.call_id
    assert len(receiver.alerts()) == 2, "the first alert was not sent again after the restart"


async def test_alerts__receiver_hangs__calls_are_answered_meanwhile(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    session_id, [action] = await pending_actions(emulator, [("charge", {"amount": 1})])
    await cut_off(database_url, session_id, action)
    with AlertReceiver(hang=True) as receiver:
        async with alerting_service(
            database_url, emulator, receiver.url, alert_timeout_seconds=60.0
        ) as service:
            await service.watch(session_id)
            await asyncio.to_thread(receiver.arrived.wait, 20.0)
            assert receiver.arrived.is_set(), "the alert's POST is in flight"

            started = time.monotonic()
            [busy] = await start_sessions(emulator, 1, Script.of_calls([("lookup", {"order_id": "A1"})]))
            await service.watch(busy)
            await wait_until_idle(emulator, [busy], within=10.0)
            answered_in = time.monotonic() - started

            assert receiver.hang, "the webhook still hangs"
            assert len(receiver.alerts()) == 1

    assert answered_in < 5.0, f"answered in {answered_in:.1f}s while the webhook hung"
    [result] = emulator.control.tool_results(busy)
    assert result.outcome == "accepted"


async def test_alerts__two_replicas__one_sends_and_the_other_takes_over_when_it_stops(
    postgres_url: str, emulator: EmulatorServer
) -> None:
    first_session, [first] = await pending_actions(emulator, [("charge", {"amount": 1})])
    second_session, [second] = await pending_actions(emulator, [("charge", {"amount": 2})])
    with AlertReceiver() as receiver:
        async with (
            alerting_service(postgres_url, emulator, receiver.url) as a,
            alerting_service(postgres_url, emulator, receiver.url) as b,
        ):
            await cut_off(postgres_url, first_session, first)
            await a.watch(first_session)
            [alert] = await alerts_received(receiver, 1)
            await asyncio.sleep(2.0)  # both replicas read the trail meanwhile
            assert len(receiver.alerts()) == 1, "one replica sent it"
            owner = await webhook_owner(postgres_url)
            sender, other = (a, b) if owner == a.replica_id else (b, a)
            assert owner == sender.replica_id
            await sender.stop()
            # Given back: free, or taken by the other replica already.
            assert await webhook_owner(postgres_url) in (None, other.replica_id)
            second_key = await cut_off(postgres_url, second_session, second)
            await other.watch(second_session)
            _, taken_over = await alerts_received(receiver, 2)
            trail = await eventually(lambda: _with_kind(timeline(postgres_url, second_key), "alert_sent", 1))

    assert alert.json["call"]["call_id"] == first.call_id
    assert taken_over.json["call"]["call_id"] == second_key.call_id
    assert {e.actor for e in trail if e.kind == "alert_sent"} == {f"alerts:{other.replica_id}"}


async def webhook_owner(database_url: str) -> str | None:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            owner: str | None = (await conn.execute(select(alert_cursors.c.owner))).scalar_one()
            return owner
    finally:
        await engine.dispose()


async def test_alerts__webhook_without_a_secret__serve_refuses_to_start(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    overrides = alert_settings("http://127.0.0.1:9/hooks", alert_webhook_secret=None)
    with pytest.raises(ConfigurationError) as refused:
        async with running_service(sqlite_url, emulator, **overrides):
            pass
    assert "TOOLLEDGER_ALERT_WEBHOOK_SECRET is not" in str(refused.value)
    assert "TOOLLEDGER_ALERT_WEBHOOK_URL" in str(refused.value)


async def test_alerts__serve_sigkilled_inside_a_handler__the_restarted_serve_alerts_unknown(
    database_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    """The real thing: `toolledger serve` configured by its environment dies (SIGKILL) inside
    an at_most_once handler; once restarted, the call is unknown and a signed alert says so."""
    [session_id] = await start_sessions(emulator, 1, Script.of_calls([("charge", {"amount": 7})]))
    with AlertReceiver() as receiver:
        webhook = {
            "TOOLLEDGER_ALERT_WEBHOOK_URL": receiver.url,
            "TOOLLEDGER_ALERT_WEBHOOK_SECRET": SIGNING_KEY,
            "TOOLLEDGER_PUBLIC_URL": PUBLIC_URL,
            # Far longer than the test: the dead replica's lease on the webhook is taken
            # because it is found gone, not because the lease ran out.
            "TOOLLEDGER_SESSION_LEASE_SECONDS": "120",
        }
        first = ServeProcess(
            database_url,
            emulator.base_url,
            tmp_path / "serve-1.log",
            crash_at="inside_handler",
            settings=webhook,
        )
        with first:
            await asyncio.to_thread(first.wait_serving)
            await watch(database_url, session_id)
            assert await asyncio.to_thread(first.wait_exit, 30.0) == -signal.SIGKILL
        with ServeProcess(
            database_url, emulator.base_url, tmp_path / "serve-2.log", settings=webhook
        ) as second:
            [alert] = await alerts_received(receiver, 1, within=30.0)
            await asyncio.sleep(1.0)
            log = second.log()

    assert_signed(alert)
    assert (alert.json["kind"], alert.json["call"]["tool"]) == ("unknown", "charge")
    assert alert.json["url"].startswith("https://ledger.example.com/ui/#call=tl_")
    assert len(receiver.alerts()) == 1
    assert "the sender's lease of a replica that is gone was freed" in log
    assert SIGNING_KEY not in log + first.log()
    assert "hooks/toolledger" not in log, "the webhook's path (it may hold a credential) is not logged"


async def watch(database_url: str, session_id: str) -> None:
    """What `toolledger sessions watch` writes: a running serve picks the session up."""
    engine = create_engine(database_url)
    try:
        await SessionStore(engine).watch(session_id)
    finally:
        await engine.dispose()


def test_serve_cli__webhook_without_secret_or_not_http__exits_naming_the_variable(
    sqlite_url: str, emulator: EmulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TOOLLEDGER_ALERT_WEBHOOK_SECRET", raising=False)
    monkeypatch.setenv("TOOLLEDGER_ALERT_WEBHOOK_URL", "https://ops.example.com/hooks/toolledger")
    no_secret = run_cli("serve", "--tools", TOOLS, database_url=sqlite_url, base_url=emulator.base_url)
    monkeypatch.setenv("TOOLLEDGER_ALERT_WEBHOOK_URL", "ops.example.com/hooks")
    not_http = run_cli("serve", "--tools", TOOLS, database_url=sqlite_url, base_url=emulator.base_url)

    assert no_secret.returncode == 1
    assert (
        "TOOLLEDGER_ALERT_WEBHOOK_URL is set but TOOLLEDGER_ALERT_WEBHOOK_SECRET is not" in no_secret.stderr
    )
    assert not_http.returncode == 2
    assert "TOOLLEDGER_ALERT_WEBHOOK_URL: not an http:// or https:// URL with a host" in not_http.stderr
    for done in (no_secret, not_http):
        assert "Traceback" not in done.stderr + done.stdout
        assert "serving:" not in done.stderr + done.stdout


async def test_alerts__call_of_a_gated_tool_awaits_approval__one_alert(
    database_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()

    @registry.tool(approval=True)
    def refund(order_id: str, cents: int) -> str:
        raise AssertionError("not approved: never run")

    session_id, [action] = await pending_actions(emulator, [("refund", {"order_id": CANARY, "cents": 900})])
    with AlertReceiver() as receiver:
        settings = service_settings(database_url, emulator, **alert_settings(receiver.url))
        async with Service(registry, settings, auto_migrate=False) as service:
            await service.watch(session_id)
            [alert] = await alerts_received(receiver, 1)
            await asyncio.sleep(1.5)  # redeliveries and reconciles: still one alert

    assert_signed(alert)
    assert (alert.json["kind"], alert.json["call"]["status"]) == ("awaiting_approval", "awaiting_approval")
    assert alert.json["call"]["tool"] == "refund"
    assert alert.json["call"]["call_id"] == action.call_id
    assert CANARY.encode() not in alert.body, "never the arguments a person is asked to approve"
    assert len(receiver.alerts()) == 1
