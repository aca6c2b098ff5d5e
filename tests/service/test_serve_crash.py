"""`toolledger serve` SIGKILLed at each crash point in the middle of a multi-session
workload, then restarted: every call ends answered exactly once, or `unknown` where its
effect class says a second run is not safe; no at_most_once handler ever runs twice."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from openai import AsyncOpenAI
from openai.types.beta.agent_session import RequiredActionSessionRequiredActionResourceFunctionCall

from tests.service.serve_process import ServeProcess, run_cli
from tests.service.tools import refunds
from tests.service.workload import (
    AT_MOST_ONCE_TOOLS,
    EVERY_CLASS_CALLS,
    every_class_script,
    read_effects,
    start_sessions,
)
from toolledger import crashpoints as cp
from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallRecord
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore

SESSIONS = 4
FunctionCallAction = RequiredActionSessionRequiredActionResourceFunctionCall

# The n-th time the point is reached: well inside the workload, not at its first call.
POINTS = {
    cp.CP_AFTER_CLAIM_COMMIT: 3,
    cp.CP_INSIDE_HANDLER: 3,
    cp.CP_AFTER_HANDLER: 3,
    cp.CP_AFTER_RESULT_COMMIT: 3,
    cp.CP_SUBMIT_ACCEPTED: 3,
    cp.CP_AFTER_SUBMIT_RESPONSE: 3,
    cp.CP_DURING_RECONCILE: 2,
}
ON_POSTGRES = (cp.CP_INSIDE_HANDLER, cp.CP_AFTER_RESULT_COMMIT)


def _cases() -> list[object]:
    cases: list[object] = [pytest.param("sqlite", p, id=f"sqlite-{p}") for p in POINTS]
    cases += [pytest.param("postgres", p, id=f"postgresql-{p}") for p in ON_POSTGRES]
    return cases


async def ledger_calls(database_url: str, session_ids: list[str]) -> dict[CallKey, CallRecord]:
    engine = create_engine(database_url)
    try:
        store = LedgerStore(engine, actor="test")
        return {c.key: c for s in session_ids for c in await store.for_session(s)}
    finally:
        await engine.dispose()


async def wait_quiescent(
    emulator: EmulatorServer, database_url: str, session_ids: list[str], within: float = 40.0
) -> dict[str, str]:
    """Every session is idle, or waits only on calls the ledger holds as `unknown` (an
    at_most_once call cut off mid-run: an operator's to settle). Returns session -> state."""
    deadline = time.monotonic() + within
    async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
        while True:
            states: dict[str, str] = {}
            sessions = await asyncio.gather(*(client.beta.agents.sessions.retrieve(s) for s in session_ids))
            calls = await ledger_calls(database_url, session_ids)
            for session in sessions:
                if session.status == "idle":
                    # ... and the service wrote down what the API accepted.
                    mine = [c for k, c in calls.items() if k.session_id == session.id]
                    if all(c.status is CallStatus.SUBMITTED for c in mine):
                        states[session.id] = "idle"
                    continue
                listed = [
                    CallKey(session.id, a.turn_id, a.call_id)
                    for a in session.required_actions
                    if isinstance(a, FunctionCallAction)
                ]
                stuck = [k for k in listed if k in calls and calls[k].status is CallStatus.UNKNOWN]
                others = [k for k in listed if k not in stuck]
                if session.status == "requires_action" and stuck and not others:
                    states[session.id] = "waiting_for_operator"
            if len(states) == len(session_ids):
                return states
            if time.monotonic() > deadline:
                raise TimeoutError(f"not quiescent: {sorted(set(session_ids) - set(states))}")
            await asyncio.sleep(0.2)


async def create_refunds_table(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(refunds.metadata.create_all)
    finally:
        await engine.dispose()


async def refund_rows(database_url: str) -> Counter[str]:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            return Counter(row.call_id for row in await conn.execute(refunds.select()))
    finally:
        await engine.dispose()


@pytest.mark.parametrize(("backend", "point"), _cases())
async def test_serve__sigkilled_at_crash_point_then_restarted__nothing_lost_nothing_repeated(
    backend: str,
    point: str,
    request: pytest.FixtureRequest,
    emulator: EmulatorServer,
    effects_file: Path,
    tmp_path: Path,
) -> None:
    database_url: str = request.getfixturevalue(f"{backend}_url")
    await create_refunds_table(database_url)
    session_ids = await start_sessions(emulator, SESSIONS, every_class_script())
    watched = run_cli("sessions", "watch", *session_ids, database_url=database_url)
    assert watched.returncode == 0, watched.stderr

    with ServeProcess(
        database_url, emulator.base_url, tmp_path / "serve-1.log", crash_at=f"{point}@{POINTS[point]}"
    ) as crashing:
        code = await asyncio.to_thread(crashing.wait_exit, 60.0)
    assert code == -signal.SIGKILL, f"the crash point was not reached:\n{crashing.log()}"
    assert f"crash point {point} reached" in crashing.log()

    with ServeProcess(database_url, emulator.base_url, tmp_path / "serve-2.log") as restarted:
        await asyncio.to_thread(restarted.wait_serving)
        states = await wait_quiescent(emulator, database_url, session_ids)

    calls = await ledger_calls(database_url, session_ids)
    effects = [e for e in read_effects(effects_file) if e.session_id in session_ids]
    runs = Counter(CallKey(e.session_id, e.turn_id, e.call_id) for e in effects)
    received = [r for r in emulator.control.tool_results() if r.session_id in session_ids]
    accepted = Counter(
        CallKey(r.session_id, r.turn_id, r.call_id) for r in received if r.outcome == "accepted"
    )

    assert all(n == 1 for n in accepted.values()), f"answered twice: {accepted}"
    waiting = {s for s, state in states.items() if state != "idle"}
    assert len(calls) == SESSIONS * EVERY_CLASS_CALLS or waiting, "every call was recorded"
    rows = await refund_rows(database_url)
    for key, call in calls.items():
        if call.tool_name in AT_MOST_ONCE_TOOLS:
            assert runs[key] <= 1, f"{key} ({call.tool_name}) ran {runs[key]} times"
        if call.tool_name == "ship":
            assert runs[key] == 1, f"verified {key} ran {runs[key]} times: the hook must settle it"
        if call.tool_name == "record_refund":
            assert rows[key.call_id] == 1, f"transactional {key}: {rows[key.call_id]} rows"
        if call.status is CallStatus.UNKNOWN:
            assert call.tool_name in AT_MOST_ONCE_TOOLS, f"{key}: only at_most_once calls may stay unknown"
            assert accepted[key] == 0
        else:
            assert call.status is CallStatus.SUBMITTED, f"{key} ended {call.status}"
            assert accepted[key] == 1, f"{key} not answered"
            ran = rows[key.call_id] if call.tool_name == "record_refund" else runs[key]
            assert ran >= 1, f"{key} answered without running"
    assert waiting <= {k.session_id for k, c in calls.items() if c.status is CallStatus.UNKNOWN}
    # The audit trail of every call starts with its recording and is ordered.
    engine = create_engine(database_url)
    try:
        store = LedgerStore(engine, actor="test")
        for key in calls:
            trail = await store.events(key)
            assert trail[0].reason == "recorded and claimed"
            assert [e.id for e in trail] == sorted(e.id for e in trail)
            if calls[key].status is CallStatus.UNKNOWN:
                # Cut off by the kill: its lease ran out, nobody guessed its outcome.
                assert any(e.to_status == "unknown" and "expired" in (e.reason or "") for e in trail)
    finally:
        await engine.dispose()
