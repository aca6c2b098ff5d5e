"""`toolledger serve` SIGKILLed at each crash point in the middle of a multi-session
workload, then restarted: every call ends answered exactly once, or `unknown` where its
effect class says a second run is not safe; no at_most_once handler ever runs twice; no call
answered is ever sent again in another request.

Each case runs against an API that keeps no Idempotency-Keys and answers a result for a call
answered already in one of the ways a real API might (``emulator.behaviour``), its first two
accepted submissions' answers lost, and the restart's first two as well: their retries meet
that refusal, and the session's state, not its wording, must say what became of the calls.
The cases go through every variant.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.support.history import assert_history, create_refunds_table, wait_quiescent
from tests.support.serve_process import ServeProcess, run_cli
from tests.support.workload import (
    every_class_script,
    start_sessions,
)
from toolledger import crashpoints as cp
from toolledger.emulator import ALREADY_ANSWERED_STYLES, AlreadyAnswered, EmulatorServer

SESSIONS = 4

# The n-th time the point is reached: well inside the workload, not at its first call.
POINTS = {
    cp.CP_AFTER_CLAIM_COMMIT: 3,
    cp.CP_INSIDE_HANDLER: 3,
    cp.CP_AFTER_HANDLER: 3,
    cp.CP_AFTER_RESULT_COMMIT: 3,
    cp.CP_AFTER_REQUEST_RECORD: 3,
    # The first lost answer's retry is refused: killed before the session is read.
    cp.CP_AFTER_SUBMIT_REFUSED: 1,
    cp.CP_SUBMIT_ACCEPTED: 3,
    cp.CP_AFTER_SUBMIT_RESPONSE: 3,
    # A session's results that were ready together went out in one request.
    cp.CP_BATCH_SUBMIT_ACCEPTED: 1,
    cp.CP_AFTER_BATCH_RESPONSE: 1,
    # Calls delivered together recorded in one commit; outcomes ready together stored in one.
    cp.CP_AFTER_BATCH_RECORD: 1,
    cp.CP_AFTER_BATCH_OUTCOMES: 1,
    cp.CP_DURING_RECONCILE: 2,
}
# PostgreSQL records a batch by one statement of its own (SQLite by a transaction).
ON_POSTGRES = (
    cp.CP_INSIDE_HANDLER,
    cp.CP_AFTER_RESULT_COMMIT,
    cp.CP_AFTER_BATCH_RECORD,
    cp.CP_AFTER_REQUEST_RECORD,
    cp.CP_AFTER_SUBMIT_REFUSED,
)


def _cases() -> list[object]:
    cases: list[object] = [pytest.param("sqlite", p, id=f"sqlite-{p}") for p in POINTS]
    cases += [pytest.param("postgres", p, id=f"postgresql-{p}") for p in ON_POSTGRES]
    return cases


def already_answered_for(backend: str, point: str) -> AlreadyAnswered:
    """Each case its variant, so that the matrix goes through every one on both databases."""
    cases = [("sqlite", p) for p in POINTS] + [("postgres", p) for p in ON_POSTGRES]
    return ALREADY_ANSWERED_STYLES[cases.index((backend, point)) % len(ALREADY_ANSWERED_STYLES)]


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
    emulator.control.set_behaviour(
        already_answered=already_answered_for(backend, point), idempotency_keys="ignored"
    )
    emulator.control.accept_then_drop(2)
    session_ids = await start_sessions(emulator, SESSIONS, every_class_script())
    watched = run_cli("sessions", "watch", *session_ids, database_url=database_url)
    assert watched.returncode == 0, watched.stderr

    with ServeProcess(
        database_url, emulator.base_url, tmp_path / "serve-1.log", crash_at=f"{point}@{POINTS[point]}"
    ) as crashing:
        code = await asyncio.to_thread(crashing.wait_exit, 60.0)
    assert code == -signal.SIGKILL, f"the crash point was not reached:\n{crashing.log()}"
    assert f"crash point {point} reached" in crashing.log()

    emulator.control.clear_faults()
    emulator.control.accept_then_drop(2)  # the restart meets lost answers too
    with ServeProcess(database_url, emulator.base_url, tmp_path / "serve-2.log") as restarted:
        await asyncio.to_thread(restarted.wait_serving)
        states = await wait_quiescent(emulator, database_url, session_ids)

    await assert_history(emulator, database_url, session_ids, states, effects_file)
    # The lost answers' retries met the API's refusal of an answered call (the variant above).
    answered: set[tuple[str, str]] = set()
    refused_replays = 0
    for receipt in emulator.control.tool_results():
        if receipt.outcome == "accepted":
            answered.add((receipt.turn_id, receipt.call_id))
        elif receipt.outcome == "rejected" and (receipt.turn_id, receipt.call_id) in answered:
            refused_replays += 1
    assert refused_replays >= 1, "no replay of an answered call met the refusal under test"
    trail = run_cli("calls", "verify-trail", "--all", database_url=database_url)
    assert trail.returncode == 0, trail.stdout + trail.stderr
    assert trail.stdout.startswith("trail intact: ")
