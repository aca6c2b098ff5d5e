"""A worker process SIGKILLed at each crash point; recovery in another process finishes the job.

Side effects are counted outside the ledger (an fsynced file; a table written in the
ledger's transaction for the transactional tool), results by the emulator's record.
"""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import func, select

from tests.runtime.crash_tools import effects, registry
from tests.runtime.crash_worker import LEASE_SECONDS
from tests.support.executor_harness import pending_actions, running_ledger
from tests.support.history import answered_then_sent_again
from tests.support.paths import ROOT
from toolledger import crashpoints as cp
from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus
from toolledger.domain.trail import check_trail
from toolledger.emulator import EmulatorServer
from toolledger.store.engine import create_engine


@dataclass(frozen=True)
class Expected:
    invocations: int
    """Times the handler's side effect happened (rows, for the transactional tool)."""
    status: CallStatus
    accepted: int
    """Results the Agents API accepted for the call."""


# Per tool and crash point: what must hold once recovery is done.
MATRIX: dict[tuple[str, str], Expected] = {
    # Claimed, handler not started: at_most_once can't know that, so it waits for an operator.
    ("at_most_once_tool", cp.CP_AFTER_CLAIM_COMMIT): Expected(0, CallStatus.UNKNOWN, 0),
    ("idempotent_tool", cp.CP_AFTER_CLAIM_COMMIT): Expected(1, CallStatus.SUBMITTED, 1),
    ("transactional_tool", cp.CP_AFTER_CLAIM_COMMIT): Expected(1, CallStatus.SUBMITTED, 1),
    # Mid side effect: never re-run at_most_once; re-run idempotent with the same key;
    # the transactional write was rolled back with the process, so its re-run is the only one.
    ("at_most_once_tool", cp.CP_INSIDE_HANDLER): Expected(1, CallStatus.UNKNOWN, 0),
    ("idempotent_tool", cp.CP_INSIDE_HANDLER): Expected(2, CallStatus.SUBMITTED, 1),
    ("transactional_tool", cp.CP_INSIDE_HANDLER): Expected(1, CallStatus.SUBMITTED, 1),
    # Handler returned, result not stored.
    ("at_most_once_tool", cp.CP_AFTER_HANDLER): Expected(1, CallStatus.UNKNOWN, 0),
    ("idempotent_tool", cp.CP_AFTER_HANDLER): Expected(2, CallStatus.SUBMITTED, 1),
    ("transactional_tool", cp.CP_AFTER_HANDLER): Expected(1, CallStatus.SUBMITTED, 1),
    # The handler said it cannot tell (MaybeExecuted), the doubt not yet stored: the lease
    # runs out into the same unknown the doubt would have made at once; never run again.
    ("maybe_executed_tool", cp.CP_AFTER_HANDLER): Expected(1, CallStatus.UNKNOWN, 0),
    # Result stored, not submitted: resubmitted, never re-run.
    ("at_most_once_tool", cp.CP_AFTER_RESULT_COMMIT): Expected(1, CallStatus.SUBMITTED, 1),
    ("idempotent_tool", cp.CP_AFTER_RESULT_COMMIT): Expected(1, CallStatus.SUBMITTED, 1),
    ("transactional_tool", cp.CP_AFTER_RESULT_COMMIT): Expected(1, CallStatus.SUBMITTED, 1),
    # Its request recorded, not posted: posted as recorded, once, never re-run.
    ("at_most_once_tool", cp.CP_AFTER_REQUEST_RECORD): Expected(1, CallStatus.SUBMITTED, 1),
    ("idempotent_tool", cp.CP_AFTER_REQUEST_RECORD): Expected(1, CallStatus.SUBMITTED, 1),
    # Accepted by the API, its answer not read or `submitted` not written: the session no
    # longer lists the call, so it is confirmed from the session's state and not sent again.
    ("at_most_once_tool", cp.CP_SUBMIT_ACCEPTED): Expected(1, CallStatus.SUBMITTED, 1),
    ("at_most_once_tool", cp.CP_AFTER_SUBMIT_RESPONSE): Expected(1, CallStatus.SUBMITTED, 1),
    ("idempotent_tool", cp.CP_AFTER_SUBMIT_RESPONSE): Expected(1, CallStatus.SUBMITTED, 1),
    ("transactional_tool", cp.CP_AFTER_SUBMIT_RESPONSE): Expected(1, CallStatus.SUBMITTED, 1),
}
ACCEPTED_BEFORE_THE_CRASH = (cp.CP_SUBMIT_ACCEPTED, cp.CP_AFTER_SUBMIT_RESPONSE)

ON_POSTGRES = {
    ("at_most_once_tool", cp.CP_INSIDE_HANDLER),
    ("idempotent_tool", cp.CP_INSIDE_HANDLER),
    ("transactional_tool", cp.CP_AFTER_HANDLER),
    ("maybe_executed_tool", cp.CP_AFTER_HANDLER),
    ("at_most_once_tool", cp.CP_AFTER_RESULT_COMMIT),
    ("idempotent_tool", cp.CP_AFTER_REQUEST_RECORD),
    ("at_most_once_tool", cp.CP_SUBMIT_ACCEPTED),
}


def _cases() -> list[object]:
    cases: list[object] = [
        pytest.param("sqlite", tool, point, id=f"sqlite-{tool}-{point}") for tool, point in MATRIX
    ]
    cases += [
        pytest.param("postgresql", tool, point, id=f"postgresql-{tool}-{point}")
        for tool, point in sorted(ON_POSTGRES)
    ]
    return cases


def run_worker(database_url: str, base_url: str, session_id: str, crash_at: str | None) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TOOLLEDGER_CRASH_AT", None)
    if crash_at:
        env["TOOLLEDGER_CRASH_AT"] = crash_at
    completed = subprocess.run(
        [sys.executable, "-m", "tests.runtime.crash_worker", database_url, base_url, session_id],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if completed.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"worker failed ({completed.returncode}):\n{completed.stderr}")
    return completed.returncode


async def count_rows(database_url: str) -> int:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(effects))).scalar_one())
    finally:
        await engine.dispose()


async def create_effects_table(database_url: str) -> None:
    engine = create_engine(database_url)
    async with engine.begin() as conn:
        await conn.run_sync(effects.metadata.create_all)
    await engine.dispose()


@pytest.mark.parametrize(("backend", "tool", "point"), _cases())
async def test_sigkill_at_crash_point__recovery_keeps_the_guarantees(
    request: pytest.FixtureRequest,
    emulator: EmulatorServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    tool: str,
    point: str,
) -> None:
    database_url: str = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "postgres_url")
    effects_file = tmp_path / "effects.log"
    effects_file.touch()
    monkeypatch.setenv("CRASH_EFFECTS_FILE", str(effects_file))
    await create_effects_table(database_url)
    session_id, [action] = await pending_actions(emulator, [(tool, {"amount": 7})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    expected = MATRIX[(tool, point)]

    returncode = await asyncio.to_thread(run_worker, database_url, emulator.base_url, session_id, point)
    assert returncode == -signal.SIGKILL, "the worker was meant to die at the crash point"

    await asyncio.sleep(LEASE_SECONDS + 0.2)  # the dead worker's lease runs out
    async with running_ledger(registry, database_url, emulator, lease_seconds=LEASE_SECONDS) as ledger:
        await ledger.recover()
        await ledger.recover()  # a second pass changes nothing
        call = await ledger.store.get(key)
        events = await ledger.store.events(key)

    if tool == "transactional_tool":
        invocations = await count_rows(database_url)
    else:
        lines = effects_file.read_text().splitlines()
        invocations = len(lines)
        assert {line.split()[1] for line in lines} <= {key.idempotency_key}, "every run used the call's key"
    received = emulator.control.tool_results(session_id)
    accepted = [r for r in received if r.outcome == "accepted"]
    assert answered_then_sent_again(received) == [], "a resend is the same request"
    if point in ACCEPTED_BEFORE_THE_CRASH:
        assert received == accepted, "confirmed from the session's state, not sent again"

    assert call is not None
    if point == cp.CP_AFTER_REQUEST_RECORD:
        assert [r.idempotency_key for r in received] == [call.request_key], "posted as it was recorded"
    assert (invocations, call.status, len(accepted)) == (
        expected.invocations,
        expected.status,
        expected.accepted,
    )
    if accepted:
        assert accepted[0].payload == call.payload, "what the API accepted is what the ledger stored"
    tokens = [e.lease_token or 0 for e in events if e.to_status == "running"]
    assert tokens == sorted(set(tokens)), "every claim took a new lease token"
    assert [e.id for e in events] == sorted(e.id for e in events)
    assert check_trail(events, call.status.value) is None, "the crash and the recovery kept one chain"


async def test_maybe_executed__a_worker_that_stored_the_doubt_leaves_it_to_the_next_untouched(
    sqlite_url: str, emulator: EmulatorServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a crash the doubt is stored at once; a second worker process given the same
    pending call neither runs it again nor answers it."""
    effects_file = tmp_path / "effects.log"
    effects_file.touch()
    monkeypatch.setenv("CRASH_EFFECTS_FILE", str(effects_file))
    session_id, [action] = await pending_actions(emulator, [("maybe_executed_tool", {"amount": 3})])
    key = CallKey(session_id, action.turn_id, action.call_id)

    for _ in range(2):
        assert await asyncio.to_thread(run_worker, sqlite_url, emulator.base_url, session_id, None) == 0
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        call = await ledger.store.get(key)
        events = await ledger.store.events(key)

    assert len(effects_file.read_text().splitlines()) == 1
    assert call is not None
    assert call.status is CallStatus.UNKNOWN
    assert [(e.from_status, e.to_status) for e in events] == [(None, "running"), ("running", "unknown")]
    assert emulator.control.tool_results(session_id) == []


async def test_sigkill__a_redelivered_call_after_the_crash_is_not_run_twice(
    sqlite_url: str, emulator: EmulatorServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service redelivers the still-pending call to a fresh worker: stored result, no re-run."""
    effects_file = tmp_path / "effects.log"
    effects_file.touch()
    monkeypatch.setenv("CRASH_EFFECTS_FILE", str(effects_file))
    session_id, _ = await pending_actions(emulator, [("at_most_once_tool", {"amount": 1})])

    assert (
        await asyncio.to_thread(
            run_worker, sqlite_url, emulator.base_url, session_id, cp.CP_AFTER_RESULT_COMMIT
        )
        == -9
    )
    assert await asyncio.to_thread(run_worker, sqlite_url, emulator.base_url, session_id, None) == 0

    assert len(effects_file.read_text().splitlines()) == 1
    assert len([r for r in emulator.control.tool_results(session_id) if r.outcome == "accepted"]) == 1


def test_each_crash_point_is_passed_at_exactly_one_place() -> None:
    """A crash point names one moment of a call's life (``after_handler`` was passed at two
    places, one per kind of tool); ``inside_handler``'s place is the effect probe of
    ``toolledger.testing``, which tools call mid side effect (test tools pass it too)."""
    passed: Counter[str] = Counter()
    for path in (ROOT / "src" / "toolledger").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and _name_of(node.func) == "crash_point" and node.args:
                passed[_name_of(node.args[0])] += 1

    points = {name: getattr(cp, name) for name in dir(cp) if name.startswith("CP_")}
    assert set(points.values()) == cp.ALL_POINTS
    assert {name: passed[name] for name in points} == dict.fromkeys(points, 1)


def _name_of(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""
