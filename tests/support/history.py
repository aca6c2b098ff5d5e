"""What must hold once a service run is over, however it was interrupted: read from the
emulator's record of tool results, the tools' effects file, the transactional tool's table
and the ledger's audit trail."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

from openai import AsyncOpenAI
from openai.types.beta.agent_session import (
    AgentSession,
    RequiredActionSessionRequiredActionResourceFunctionCall,
)
from sqlalchemy import select

from tests.support.polling import eventually
from tests.support.service_tools import refunds
from tests.support.workload import AT_MOST_ONCE_TOOLS, EVERY_CLASS_CALLS, read_effects
from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallEvent, CallRecord
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, ReceivedToolResult
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import tool_calls

FunctionCallAction = RequiredActionSessionRequiredActionResourceFunctionCall


async def ledger_calls(database_url: str, session_ids: list[str]) -> dict[CallKey, CallRecord]:
    """Every call of these sessions, a few queries for thousands of sessions."""
    engine = create_engine(database_url)
    try:
        store = LedgerStore(engine, actor="test")
        calls: dict[CallKey, CallRecord] = {}
        async with engine.connect() as conn:
            for start in range(0, len(session_ids), 500):
                chunk = session_ids[start : start + 500]
                rows = await conn.execute(
                    select(tool_calls.c.session_id, tool_calls.c.turn_id, tool_calls.c.call_id).where(
                        tool_calls.c.session_id.in_(chunk)
                    )
                )
                keys = [CallKey(r.session_id, r.turn_id, r.call_id) for r in rows]
                calls.update(await store.get_many(keys))
        return calls
    finally:
        await engine.dispose()


async def wait_quiescent(
    emulator: EmulatorServer, database_url: str, session_ids: list[str], within: float = 40.0
) -> dict[str, str]:
    """Every session is idle, or waits only on at_most_once calls the ledger holds as
    `unknown` (cut off mid-run: an operator's to settle). Returns session -> state."""
    slots = asyncio.Semaphore(32)  # thousands of sessions: don't swamp the emulator
    # What the last look saw: for the result, and for the message if the time runs out.
    sessions: list[AgentSession] = []
    calls: dict[CallKey, CallRecord] = {}
    states: dict[str, str] = {}

    async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:

        async def retrieve(session_id: str) -> AgentSession:
            async with slots:
                return await client.beta.agents.sessions.retrieve(session_id)

        async def quiescent() -> bool:
            states.clear()
            sessions[:] = await asyncio.gather(*(retrieve(s) for s in session_ids))
            calls.clear()
            calls.update(await ledger_calls(database_url, session_ids))
            # Grouped once: a scan of every call per session held the GIL for seconds at
            # thousands of sessions, starving the in-process emulator the service talks to.
            by_session: dict[str, list[CallRecord]] = {}
            for key, call in calls.items():
                by_session.setdefault(key.session_id, []).append(call)
            for session in sessions:
                if session.status == "idle":
                    # ... and the service wrote down what the API accepted.
                    mine = by_session.get(session.id, [])
                    if all(c.status is CallStatus.SUBMITTED for c in mine):
                        states[session.id] = "idle"
                    continue
                listed = [
                    CallKey(session.id, a.turn_id, a.call_id)
                    for a in session.required_actions
                    if isinstance(a, FunctionCallAction)
                ]
                # Only an at_most_once call stays `unknown`: any other is there for a moment,
                # between its lease expiring and the service running it again.
                stuck = [
                    k
                    for k in listed
                    if k in calls
                    and calls[k].status is CallStatus.UNKNOWN
                    and calls[k].tool_name in AT_MOST_ONCE_TOOLS
                ]
                others = [k for k in listed if k not in stuck]
                # Every other call of the session must be written down as submitted too: the
                # API may have accepted one a moment ago while the service has yet to mark it.
                done = (CallStatus.SUBMITTED, CallStatus.UNKNOWN)
                settled = all(c.status in done for c in by_session.get(session.id, []))
                if session.status == "requires_action" and stuck and not others and settled:
                    states[session.id] = "waiting_for_operator"
            return len(states) == len(session_ids)

        def stragglers() -> str:
            by_id = {s.id: s for s in sessions}
            left = sorted(set(session_ids) - set(states))
            details = [describe_straggler(by_id[s], calls) for s in left[:20]]
            return f"{len(left)} session(s) not quiescent:\n" + "\n".join(details)

        await eventually(quiescent, within=within, what=stragglers, interval=0.2)
    return states


def describe_straggler(session: AgentSession, calls: dict[CallKey, CallRecord]) -> str:
    """Why a session is not settled: its API status, what it awaits and the ledger's view."""
    listed = [f"{a.call_id}" for a in session.required_actions if isinstance(a, FunctionCallAction)]
    mine = sorted(
        f"{k.call_id}:{c.tool_name}:{c.status.value}:attempts={c.attempt_count}:submissions={c.submission_count}"
        for k, c in calls.items()
        if k.session_id == session.id
    )
    return f"{session.id} status={session.status} awaits={listed} ledger={mine}"


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


async def assert_history(
    emulator: EmulatorServer,
    database_url: str,
    session_ids: list[str],
    states: dict[str, str],
    effects_file: Path,
    calls_per_session: int = EVERY_CLASS_CALLS,
) -> dict[str, int]:
    """Per call: answered exactly once with one unchanging payload, or `unknown` (at_most_once
    only, never answered); at_most_once and verified handlers ran at most / exactly once;
    transactional rows exactly once; every audit trail complete and ordered. Returns figures."""
    calls = await ledger_calls(database_url, session_ids)
    effects = [e for e in read_effects(effects_file) if e.session_id in session_ids]
    runs = Counter(CallKey(e.session_id, e.turn_id, e.call_id) for e in effects)
    received = [r for r in emulator.control.tool_results() if r.session_id in session_ids]
    accepted = Counter(
        CallKey(r.session_id, r.turn_id, r.call_id) for r in received if r.outcome == "accepted"
    )

    duplicates = sum(1 for k, c in calls.items() if c.tool_name in AT_MOST_ONCE_TOOLS and runs[k] > 1)
    assert duplicates == 0, "an at_most_once handler ran twice"
    assert all(n == 1 for n in accepted.values()), f"answered twice: {accepted}"
    waiting = {s for s, state in states.items() if state != "idle"}
    assert len(calls) == len(session_ids) * calls_per_session or waiting, "every call was recorded"
    payloads: dict[CallKey, set[str]] = {}
    for r in received:
        payloads.setdefault(CallKey(r.session_id, r.turn_id, r.call_id), set()).add(
            json.dumps(r.payload, sort_keys=True)
        )
    assert all(len(p) == 1 for p in payloads.values()), "a result changed between submissions"
    sent_again = answered_then_sent_again(received)
    assert not sent_again, "answered, then sent again in another request:\n" + "\n".join(
        map(str, sent_again[:10])
    )
    rows = await refund_rows(database_url)
    trails = await _trails(database_url, list(calls))
    # A call whose every attempt was cut off by a kill is given up after max_attempts: it is
    # answered with a fixed failure and the reason in its trail, and its side effects are
    # whatever the cut-off runs left (a transactional call's: none, all rolled back).
    given_up = {
        key for key, trail in trails.items() if any("gave up after" in (e.reason or "") for e in trail)
    }
    for key in given_up:
        assert calls[key].status is CallStatus.SUBMITTED, f"given-up {key} ended {calls[key].status}"
        (payload,) = payloads[key]
        assert json.loads(payload)["success"] is False, f"given-up {key} was answered as a success"
        assert calls[key].attempt_count >= 2, f"{key} given up after {calls[key].attempt_count} attempt"
    for key, call in calls.items():
        if call.tool_name in AT_MOST_ONCE_TOOLS:
            assert runs[key] <= 1, f"{key} ({call.tool_name}) ran {runs[key]} times"
        if call.tool_name == "ship":
            # Given up, every claim was cut off (a verified call given up after max_attempts
            # may never have reached its handler); else the hook settles the first run's outcome.
            expected_runs = (0, 1) if key in given_up else (1,)
            assert runs[key] in expected_runs, (
                f"verified {key} ran {runs[key]} times: the hook must settle it"
            )
        if call.tool_name == "record_refund":
            expected_rows = 0 if key in given_up else 1
            assert rows[key.call_id] == expected_rows, f"transactional {key}: {rows[key.call_id]} rows"
        if call.status is CallStatus.UNKNOWN:
            assert call.tool_name in AT_MOST_ONCE_TOOLS, f"{key}: only at_most_once calls may stay unknown"
            assert accepted[key] == 0
        else:
            assert call.status is CallStatus.SUBMITTED, f"{key} ended {call.status}"
            assert accepted[key] == 1, f"{key} not answered"
            ran = rows[key.call_id] if call.tool_name == "record_refund" else runs[key]
            assert ran >= 1 or key in given_up, f"{key} answered without running"
    assert waiting <= {k.session_id for k, c in calls.items() if c.status is CallStatus.UNKNOWN}
    # The audit trail of every call starts with its recording and is ordered.
    for key, trail in trails.items():
        assert trail[0].reason == "recorded and claimed"
        assert [e.id for e in trail] == sorted(e.id for e in trail)
        if calls[key].status is CallStatus.UNKNOWN:
            # Cut off by the kill: its lease ran out, or its owner was found gone; nobody
            # guessed its outcome.
            assert any(e.to_status == "unknown" and _cut_off(e.reason) for e in trail)
    unknown = sum(c.status is CallStatus.UNKNOWN for c in calls.values())
    return {
        "calls": len(calls),
        "answered": len(accepted),
        "answered_then_sent_again": len(sent_again),
        "replays_of_answered": sum(1 for r in received if r.outcome == "replayed"),
        "unknown": unknown,
        "at_most_once_duplicates": duplicates,
        "lost": len(calls) - len(accepted) - unknown,
        "effects": len(effects),
        "given_up": len(given_up),
    }


def answered_then_sent_again(received: list[ReceivedToolResult]) -> list[ReceivedToolResult]:
    """Submissions of a call after it was answered that are not a replay of the request that
    answered it (the same Idempotency-Key and the same body), in the order received. A resend
    is the same request: whatever the API makes of a replay (it may refuse one, if it keeps no
    keys), a second, different request for an answered call must never be sent."""
    answered_by: dict[tuple[str, str, str], ReceivedToolResult] = {}
    again: list[ReceivedToolResult] = []
    for receipt in received:
        key = (receipt.session_id, receipt.turn_id, receipt.call_id)
        first = answered_by.get(key)
        if first is None:
            if receipt.outcome == "accepted":
                answered_by[key] = receipt
            continue
        if (receipt.idempotency_key, receipt.request_sha256) != (first.idempotency_key, first.request_sha256):
            again.append(receipt)
    return again


async def _trails(database_url: str, keys: list[CallKey]) -> dict[CallKey, list[CallEvent]]:
    engine = create_engine(database_url)
    try:
        store = LedgerStore(engine, actor="test")
        return {key: await store.events(key) for key in keys}
    finally:
        await engine.dispose()


def _cut_off(reason: str | None) -> bool:
    return reason is not None and ("expired" in reason or "is gone" in reason)
