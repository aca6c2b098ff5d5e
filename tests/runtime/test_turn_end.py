"""A completed turn's results confirmed from the ``turn.completed`` event alone: only when they
are all the session has open, on real SQLite and PostgreSQL, against the emulator."""

from __future__ import annotations

import logging

import pytest

from tests.support.executor_harness import pending_actions, running_ledger
from tests.support.polling import eventually
from tests.support.service_harness import running_service
from tests.support.workload import start_sessions, wait_until_idle
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, Script
from toolledger.runtime.reconciler import Reconciler
from toolledger.runtime.registry import ToolRegistry
from toolledger.store.sessions import SessionStore


async def test_confirm_turn__only_when_its_submitted_calls_are_all_that_is_open(
    database_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    registry.tool(name="ping", effect="read_only")(lambda: "pong")
    session_id, [first, second] = await pending_actions(emulator, [("ping", {}), ("ping", {})])
    turn_id = first.turn_id

    async with running_ledger(registry, database_url, emulator, submit_attempts=1) as ledger:
        sessions = SessionStore(ledger.engine)
        reconciler = Reconciler(ledger.executor, ledger.gateway, sessions)
        busy = Reconciler(ledger.executor, ledger.gateway, sessions, in_flight=lambda _key: True)
        store = ledger.store

        sent = await ledger.handle(session_id, first)
        emulator.control.fail_submissions(50, status=400, session_id=session_id)
        unsent = await ledger.handle(session_id, second)
        emulator.control.clear_faults()
        stored = await store.get(unsent.key)
        assert stored is not None
        assert stored.status is CallStatus.SUCCEEDED, "the second result is stored, not submitted"

        assert await reconciler.confirm_turn(session_id, turn_id) is None, "a stored result is open"
        await ledger.handle(session_id, second)  # now submitted too
        assert await reconciler.confirm_turn(session_id, "turn_another") is None
        assert await busy.confirm_turn(session_id, turn_id) is None, "a call still on its way here"
        calls = [await store.get(key) for key in (sent.key, unsent.key)]
        assert all(c is not None and c.confirmed_at is None for c in calls), "nothing confirmed yet"

        assert await reconciler.confirm_turn(session_id, turn_id) == 2
        assert await store.open_calls(session_id) == []
        assert await reconciler.confirm_turn(session_id, turn_id) is None, "nothing open any more"


async def test_service__a_completed_turn__its_results_confirmed_from_the_event_alone(
    database_url: str, emulator: EmulatorServer, caplog: pytest.LogCaptureFixture
) -> None:
    script = Script.of_calls([("notify", {"message": "a"}), ("notify", {"message": "b"})])
    caplog.set_level(logging.INFO, logger="toolledger")
    # No periodic pass: one running when the event arrives would take the turn's calls first.
    async with running_service(database_url, emulator, reconcile_interval_seconds=600.0) as service:
        [session_id] = await start_sessions(emulator, 1, script)
        await service.watch(session_id)
        await wait_until_idle(emulator, [session_id])
        store = service.ledger.store

        async def all_confirmed() -> bool:
            return not await store.open_calls(session_id)

        await eventually(all_confirmed, within=10.0, what="the turn's calls confirmed")

    turns = [r for r in caplog.records if "completed: {'confirmed': 2}" in r.getMessage()]
    assert len(turns) == 1, [r.getMessage() for r in caplog.records]


async def test_reconcile_session__counts_what_it_did_by_plain_names(
    database_url: str, emulator: EmulatorServer
) -> None:
    # The counts go into the log line and the JSON summary as they are: words, not enum reprs.
    registry = ToolRegistry()
    registry.tool(name="ping", effect="read_only")(lambda: "pong")
    session_id, _actions = await pending_actions(emulator, [("ping", {}), ("ping", {})])

    async with running_ledger(registry, database_url, emulator) as ledger:
        reconciler = Reconciler(ledger.executor, ledger.gateway, SessionStore(ledger.engine))
        result = await reconciler.reconcile_session(session_id)

    assert {repr(action): n for action, n in result.actions.items()} == {"'executed'": 2}
