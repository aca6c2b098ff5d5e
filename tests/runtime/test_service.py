"""The service in this process, against the emulator over HTTP with the real SDK, on real
SQLite and PostgreSQL: a multi-session workload under every fault the emulator can inject."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from sqlalchemy import text

from tests.support.history import ledger_calls
from tests.support.polling import eventually
from tests.support.service_harness import running_service, service_settings
from tests.support.service_tools import registry
from tests.support.workload import (
    CALLS_PER_SESSION,
    assert_exactly_once,
    read_effects,
    start_sessions,
    wait_until_idle,
)
from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, Script
from toolledger.errors import ToolLedgerError
from toolledger.gateway.agents import AgentsGateway
from toolledger.runtime import service as service_module
from toolledger.runtime.service import Service
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.sessions import SessionStore

SESSIONS = 6


async def watch_all(service: Service, session_ids: list[str]) -> None:
    for session_id in session_ids:
        await service.watch(session_id)


async def session_records(database_url: str) -> dict[str, Any]:
    engine = create_engine(database_url)
    try:
        return {r.session_id: r for r in await SessionStore(engine).find(watched=None)}
    finally:
        await engine.dispose()


async def test_service__many_sessions__every_call_answered_once(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    async with running_service(database_url, emulator) as service:
        session_ids = await start_sessions(emulator, SESSIONS)
        await watch_all(service, session_ids)
        await wait_until_idle(emulator, session_ids)

    figures = assert_exactly_once(emulator, session_ids, effects_file, CALLS_PER_SESSION)
    assert figures["effects"] == SESSIONS * CALLS_PER_SESSION, "each handler ran exactly once"
    calls = await ledger_calls(database_url, session_ids)
    assert len(calls) == SESSIONS * CALLS_PER_SESSION
    assert {c.status for c in calls.values()} == {CallStatus.SUBMITTED}


def _close_streams_drop(emulator: EmulatorServer) -> None:
    emulator.control.close_streams(after_events=3, count=20, mode="drop")


def _close_streams_end(emulator: EmulatorServer) -> None:
    emulator.control.close_streams(after_events=2, count=20, mode="end")


def _server_errors(emulator: EmulatorServer) -> None:
    emulator.control.fail_submissions(count=8, status=503)


def _accept_then_drop(emulator: EmulatorServer) -> None:
    emulator.control.accept_then_drop(count=6)


def _drop_before_apply(emulator: EmulatorServer) -> None:
    emulator.control.drop_before_apply(count=6)


def _pending_race(emulator: EmulatorServer) -> None:
    emulator.control.delay_registration(0.3, steps=6)
    emulator.control.unknown_pending(count=4)


def _duplicate_events(emulator: EmulatorServer) -> None:
    emulator.control.duplicate_events()


FAULTS: dict[str, Callable[[EmulatorServer], None]] = {
    "dropped_streams": _close_streams_drop,
    "ended_streams": _close_streams_end,
    "server_errors": _server_errors,
    "accepted_then_dropped": _accept_then_drop,
    "dropped_before_apply": _drop_before_apply,
    "pending_call_race": _pending_race,
    "duplicate_events": _duplicate_events,
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_service__under_fault__every_call_answered_once_and_run_once(
    fault: str, database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    FAULTS[fault](emulator)
    async with running_service(database_url, emulator) as service:
        session_ids = await start_sessions(emulator, SESSIONS)
        await watch_all(service, session_ids)
        await wait_until_idle(emulator, session_ids)

    assert_exactly_once(emulator, session_ids, effects_file, CALLS_PER_SESSION)
    effects = read_effects(effects_file)
    charged = [e for e in effects if e.tool == "charge"]
    assert len(charged) == 2 * SESSIONS, "every charge ran once: none lost, none repeated"
    armed = emulator.control.faults()
    # A counted fault disappears once used up; whatever is left must have fired.
    assert all(f["fired"] > 0 for f in armed), f"the fault never fired: {armed}"


async def test_service__duplicate_deliveries__do_not_even_reach_the_ledger_twice(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    emulator.control.duplicate_events()
    async with running_service(sqlite_url, emulator) as service:
        session_ids = await start_sessions(emulator, 2)
        await watch_all(service, session_ids)
        await wait_until_idle(emulator, session_ids)

    assert len(read_effects(effects_file)) == 2 * CALLS_PER_SESSION
    received = [r for r in emulator.control.tool_results() if r.session_id in session_ids]
    assert [r.outcome for r in received] == ["accepted"] * len(received), "no submission repeated"


def slow_script(pause_ms: int) -> Script:
    return Script.of_calls([("charge", {"amount": 1, "pause_ms": pause_ms})])


async def test_service__session_fails_mid_call__call_abandoned_and_session_unwatched(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    async with running_service(database_url, emulator) as service:
        [session_id] = await start_sessions(emulator, 1, slow_script(pause_ms=600))
        await service.watch(session_id)
        await eventually(lambda: read_effects(effects_file))  # the handler is running
        emulator.control.fail_session(session_id, "model crashed")
        await eventually(lambda: session_id not in service.followed)

    [call] = (await ledger_calls(database_url, [session_id])).values()
    assert call.status is CallStatus.ABANDONED
    assert call.abandoned_reason == "session failed: model crashed"
    record = (await session_records(database_url))[session_id]
    assert (record.watched, record.status, record.reason) == (
        False,
        "failed",
        "session failed: model crashed",
    )
    assert not emulator.control.accepted_results(session_id)


async def test_service__session_deleted__unwatched_with_reason(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    async with running_service(database_url, emulator) as service:
        [session_id] = await start_sessions(emulator, 1)
        await service.watch(session_id)
        await wait_until_idle(emulator, [session_id])
        async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
            await client.beta.agents.sessions.delete(session_id)
        await eventually(lambda: session_id not in service.followed)

    record = (await session_records(database_url))[session_id]
    assert (record.watched, record.status, record.reason) == (False, "deleted", "session deleted")
    calls = await ledger_calls(database_url, [session_id])
    assert {c.status for c in calls.values()} == {CallStatus.SUBMITTED}, "answered calls stay answered"


async def test_service__turn_cancelled_while_handler_runs__result_kept_call_abandoned(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    async with running_service(sqlite_url, emulator) as service:
        [session_id] = await start_sessions(emulator, 1, slow_script(pause_ms=500))
        await service.watch(session_id)
        await eventually(lambda: read_effects(effects_file))
        emulator.control.cancel_turn(session_id)

        async def abandoned() -> bool:
            [call] = (await ledger_calls(sqlite_url, [session_id])).values()
            return call.status is CallStatus.ABANDONED

        await eventually(abandoned)

    [call] = (await ledger_calls(sqlite_url, [session_id])).values()
    assert call.result is not None, "the handler's outcome stays on the record"
    assert call.abandoned_reason == "no longer awaited by the session"
    assert len(read_effects(effects_file)) == 1
    assert not emulator.control.accepted_results(session_id)


async def test_service__second_service_on_one_sqlite_file__refused_clearly(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    async with running_service(sqlite_url, emulator):
        second = Service(registry, service_settings(sqlite_url, emulator), auto_migrate=False)
        with pytest.raises(ToolLedgerError, match=r"already served by pid .*for replicas use PostgreSQL"):
            await second.start()
    # Once the first is gone, the file can be served again.
    async with running_service(sqlite_url, emulator) as again:
        assert again.status().started


async def test_service__watched_from_another_process_view__followed_within_seconds(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    async with running_service(database_url, emulator) as service:
        [session_id] = await start_sessions(emulator, 1)
        engine = create_engine(database_url)
        try:
            await SessionStore(engine).watch(session_id)  # what `toolledger sessions watch` does
        finally:
            await engine.dispose()
        await eventually(lambda: session_id in service.followed, within=5.0)
        await wait_until_idle(emulator, [session_id])

    assert_exactly_once(emulator, [session_id], effects_file, CALLS_PER_SESSION)


async def test_service__discovery_by_metadata__follows_matching_sessions_only(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    async with running_service(
        sqlite_url, emulator, discover_metadata={"app": "shop"}, discover_interval_seconds=0.2
    ) as service:
        ours = await start_sessions(emulator, 2, app="shop")
        theirs = await start_sessions(emulator, 1, app="other")
        await wait_until_idle(emulator, ours)
        await asyncio.sleep(0.5)
        assert not service.followed & set(theirs)

    assert_exactly_once(emulator, ours, effects_file, CALLS_PER_SESSION)
    assert not emulator.control.accepted_results(theirs[0])


async def test_service__graceful_stop__finishes_short_calls_and_leaves_long_ones_to_lease_expiry(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    service = Service(registry, service_settings(sqlite_url, emulator, lease_seconds=0.5), auto_migrate=False)
    await service.start()
    short, long = await start_sessions(emulator, 1, slow_script(300)) + await start_sessions(
        emulator, 1, slow_script(3000)
    )
    await service.watch(short)
    await service.watch(long)
    await eventually(lambda: len(read_effects(effects_file)) == 2)
    cut_off = await service.stop(grace=1.0)

    assert cut_off == 1
    calls = await ledger_calls(sqlite_url, [short, long])
    by_session = {key.session_id: call for key, call in calls.items()}
    assert by_session[short].status is CallStatus.SUBMITTED
    assert by_session[long].status is CallStatus.RUNNING, "left as a crash would leave it"
    records = await session_records(sqlite_url)
    assert records[short].owner is None, "leases given back"
    assert records[long].owner is None
    # A new service finds the lease expired: the at_most_once call is unknown, never re-run.
    await asyncio.sleep(0.6)
    async with running_service(sqlite_url, emulator, lease_seconds=0.5):

        async def unknown() -> bool:
            call = (await ledger_calls(sqlite_url, [long]))[by_session[long].key]
            return call.status is CallStatus.UNKNOWN

        await eventually(unknown)
    assert [e.session_id for e in read_effects(effects_file)].count(long) == 1


async def test_service__approval_requests_beside_function_calls__left_alone_and_logged_once(
    sqlite_url: str,
    emulator: EmulatorServer,
    effects_file: Path,
    async_client: AsyncOpenAI,
    caplog: pytest.LogCaptureFixture,
) -> None:
    script = Script.model_validate(
        {
            "steps": [
                {"calls": [{"name": "lookup", "arguments": {"order_id": "A1"}}], "approvals": ["files"]},
                {"calls": [{"name": "notify", "arguments": {"message": "x", "pause_ms": 200}}]},
            ]
        }
    )
    [session_id] = await start_sessions(emulator, 1, script)
    await eventually(lambda: _lists_approval(async_client, session_id))
    caplog.set_level("INFO", logger="toolledger.reconciler")
    async with running_service(sqlite_url, emulator) as service:
        await service.watch(session_id)
        await wait_until_idle(emulator, [session_id])

    assert_exactly_once(emulator, [session_id], effects_file, 2)
    notes = [r for r in caplog.records if "mcp_approval_request action" in r.getMessage()]
    assert len(notes) == 1, "logged once, however often it was listed"
    received = emulator.control.tool_results(session_id)
    assert {r.call_id for r in received} == {k.call_id for k in await ledger_calls(sqlite_url, [session_id])}


async def _lists_approval(client: AsyncOpenAI, session_id: str) -> bool:
    session = await client.beta.agents.sessions.retrieve(session_id)  # strict parsing of every action
    return any(action.type == "mcp_approval_request" for action in session.required_actions)


async def test_service__accepted_but_never_applied__resubmitted_at_a_bounded_rate_and_flagged(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    """A 202 means accepted, not consumed: a call still awaited is sent again (same bytes,
    same key), no faster than the reconcile interval, and flagged for an operator."""
    [session_id] = await start_sessions(emulator, 1, Script.of_calls([("lookup", {"order_id": "A1"})]))
    emulator.control.accept_without_apply(session_id=session_id)
    interval = 0.3
    async with running_service(
        sqlite_url, emulator, resubmit_after_seconds=0.2, reconcile_interval_seconds=interval
    ) as service:
        started = asyncio.get_running_loop().time()
        await service.watch(session_id)

        async def flagged() -> bool:
            calls = list((await ledger_calls(sqlite_url, [session_id])).values())
            return bool(calls) and calls[0].submission_count >= 6

        await eventually(flagged, within=15.0)
        elapsed = asyncio.get_running_loop().time() - started

    [call] = (await ledger_calls(sqlite_url, [session_id])).values()
    assert call.status is CallStatus.SUBMITTED
    assert call.confirmed_at is None, "never confirmed: the session still awaits it"
    engine = create_engine(sqlite_url)
    try:
        trail = await LedgerStore(engine, actor="test").events(call.key)
    finally:
        await engine.dispose()
    assert [e.kind for e in trail].count("unconfirmed") == 1, "one alert, not one per resubmission"
    received = emulator.control.tool_results(session_id)
    assert received[0].outcome == "lost"
    assert {r.outcome for r in received[1:]} == {"replayed"}
    assert len({r.idempotency_key for r in received}) == 1
    assert len({json.dumps(r.payload, sort_keys=True) for r in received}) == 1
    assert len(received) <= elapsed / interval + 3, "no tight loop"
    assert len(read_effects(effects_file)) == 1


def test_service_lock__on_postgresql__is_a_no_op_and_writes_no_file(tmp_path: Path) -> None:
    from toolledger.store.exclusive import SQLiteServiceLock

    first = SQLiteServiceLock("postgresql+psycopg://postgres@127.0.0.1/some_db")
    second = SQLiteServiceLock("postgresql+psycopg://postgres@127.0.0.1/some_db")
    first.acquire()
    second.acquire()  # replicas share a PostgreSQL ledger: never refused
    first.release()
    second.release()
    assert first.path is None
    assert not list(Path.cwd().glob("some_db*"))


async def test_service__handling_stopped_by_a_database_error__looked_at_again_in_seconds_not_at_the_timer(
    postgres_url: str, emulator: EmulatorServer, effects_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The database refuses to store a handler's outcome (a trigger raising, as a full disk
    or a broken constraint would), so handling the call stops on the error with the call
    still running under its lease. Once the database takes writes again, the call is looked
    at when its lease can run out (and, idempotent, run again), not left to a reconcile timer
    ten minutes away."""
    await _sql(
        postgres_url,
        "CREATE FUNCTION refuse_outcomes() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN RAISE EXCEPTION 'no space left on device'; END $$",
        "CREATE TRIGGER refuse_outcomes BEFORE UPDATE ON tool_calls FOR EACH ROW"
        " WHEN (NEW.tool_name = 'notify' AND NEW.status IN ('succeeded', 'failed'))"
        " EXECUTE FUNCTION refuse_outcomes()",
    )
    # The second step's call arrives on the session's event stream, not in the watch's
    # first reconcile pass (which would look again after any error of its own).
    script = Script.of_calls([("lookup", {"order_id": "A1"})], [("notify", {"message": "hi"})])
    async with running_service(
        postgres_url, emulator, lease_seconds=2.0, database_retry_seconds=0, reconcile_interval_seconds=600
    ) as service:
        [session_id] = await start_sessions(emulator, 1, script)
        await service.watch(session_id)
        await eventually(
            lambda: any("stopped" in r.getMessage() for r in caplog.records), what="handling stopped"
        )
        await _sql(postgres_url, "DROP TRIGGER refuse_outcomes ON tool_calls")
        await eventually(
            lambda: len(emulator.control.accepted_results(session_id)) == 2, within=15.0, what="both answered"
        )

    calls = (await ledger_calls(postgres_url, [session_id])).values()
    assert [c.status for c in calls] == [CallStatus.SUBMITTED] * 2
    notified = [e for e in read_effects(effects_file) if e.tool == "notify"]
    assert len(notified) == 2, "run again once its lease ran out"


async def _sql(database_url: str, *statements: str) -> None:
    engine = create_engine(database_url)
    try:
        async with engine.begin() as conn:
            for statement in statements:
                await conn.execute(text(statement))
    finally:
        await engine.dispose()


async def test_service__a_turns_parallel_results_go_out_in_one_request_a_lone_one_alone(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    """The turn continues only once it has every result, so the results of its calls that run
    here together are sent together when their handlers end within a moment of each other
    (``SIBLING_WAIT_SECONDS``); the next step's lone call is sent at once, under its own key."""
    script = Script.of_calls(
        [("notify", {"message": m, "pause_ms": ms}) for m, ms in (("a", 0), ("b", 150), ("c", 300))],
        [("lookup", {"order_id": "A1"})],
    )
    async with running_service(database_url, emulator) as service:
        [session_id] = await start_sessions(emulator, 1, script)
        await service.watch(session_id)
        await wait_until_idle(emulator, [session_id])

    receipts = emulator.control.tool_results(session_id)
    assert [r.outcome for r in receipts] == ["accepted"] * 4
    parallel, lone = receipts[:3], receipts[3]
    assert len({r.idempotency_key for r in parallel}) == 1, "one request for the three"
    assert parallel[0].idempotency_key is not None
    assert parallel[0].idempotency_key.startswith("tlb_")
    assert lone.idempotency_key == CallKey(session_id, lone.turn_id, lone.call_id).idempotency_key


async def test_service__a_slow_tool__its_sessions_ready_results_do_not_hold_every_slot(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    # Two handler slots. Session A: one slow call and two quick ones; the quick ones' results
    # wait a moment (SIBLING_WAIT_SECONDS) to go in one request with the slow one's, then go
    # without it. Were they to wait for it, they would hold both slots until it finished, and
    # B's call could not run. (A slot is held while a handler runs, not while its result waits
    # to be sent: B may even be answered first.)
    slow = Script.of_calls(
        [
            ("notify", {"message": "slow", "pause_ms": 8000}),
            ("notify", {"message": "a1"}),
            ("notify", {"message": "a2"}),
        ]
    )
    async with running_service(database_url, emulator, max_concurrent_calls=2) as service:
        [session_a] = await start_sessions(emulator, 1, slow)
        await watch_all(service, [session_a])

        async def slow_running() -> bool:
            calls = await ledger_calls(database_url, [session_a])
            return any(c.status is CallStatus.RUNNING for c in calls.values())

        await eventually(slow_running, within=10.0, what=lambda: "the slow call never started")
        [session_b] = await start_sessions(emulator, 1, Script.of_calls([("notify", {"message": "b"})]))
        await watch_all(service, [session_b])
        await wait_until_idle(emulator, [session_b], within=6.0)

        async def quick_ones_sent() -> dict[str, CallStatus] | None:
            calls = await ledger_calls(database_url, [session_a])
            by_message = {json.loads(c.arguments)["message"]: c.status for c in calls.values()}
            return by_message if by_message["a1"] is by_message["a2"] is CallStatus.SUBMITTED else None

        by_message = await eventually(quick_ones_sent, within=4.0, what="A's quick results sent")
        assert by_message["slow"] is CallStatus.RUNNING, "B and A's quick ones before A's slow one"
        await wait_until_idle(emulator, [session_a], within=20.0)


async def test_service__a_restart_with_many_watched_sessions__opens_their_streams_a_few_at_a_time(
    database_url: str, emulator: EmulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # All opened at once, a thousand streams kept every session's first reconcile waiting for
    # tens of seconds; taken in turn (those with calls to move on first), answers go out first.
    opening = most = opened = 0
    real_events = AgentsGateway.events

    @asynccontextmanager
    async def counted(self: AgentsGateway, session_id: str, **options: Any) -> Any:
        nonlocal opening, most, opened
        opening += 1
        most = max(most, opening)
        stream = real_events(self, session_id, **options)
        try:
            events = await stream.__aenter__()
        finally:
            opening -= 1
        opened += 1
        try:
            yield events
        finally:
            await stream.__aexit__(None, None, None)

    monkeypatch.setattr(AgentsGateway, "events", counted)
    session_ids = await start_sessions(
        emulator, 3 * service_module.STREAMS_OPENING_AT_ONCE, Script.of_calls()
    )
    engine = create_engine(database_url)
    try:
        await SessionStore(engine).watch_new(session_ids)
    finally:
        await engine.dispose()

    async with running_service(database_url, emulator):
        await eventually(lambda: opened >= len(session_ids), within=20.0, what=lambda: f"{opened} opened")

    assert 1 < most <= service_module.STREAMS_OPENING_AT_ONCE
