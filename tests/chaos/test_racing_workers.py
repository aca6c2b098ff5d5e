"""2, 4 and 8 worker processes answering the same sessions at once: every call runs once
and is answered once, whoever wins each race."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.support.history import create_refunds_table, ledger_calls, refund_rows
from tests.support.paths import ROOT
from tests.support.workload import EVERY_CLASS_CALLS, every_class_script, read_effects, start_sessions
from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer

SESSIONS = 5


def _cases() -> list[object]:
    cases: list[object] = [pytest.param("postgres", n, id=f"postgresql-{n}") for n in (2, 4, 8)]
    cases.append(pytest.param("sqlite", 4, id="sqlite-4"))
    return cases


@pytest.mark.parametrize(("backend", "workers"), _cases())
async def test_racing_workers__same_sessions__each_call_runs_once_and_is_answered_once(
    backend: str, workers: int, request: pytest.FixtureRequest, emulator: EmulatorServer, effects_file: Path
) -> None:
    database_url: str = request.getfixturevalue(f"{backend}_url")
    await create_refunds_table(database_url)
    session_ids = await start_sessions(emulator, SESSIONS, every_class_script())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TOOLLEDGER_CRASH_AT", None)
    racers = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.chaos.racer",
            database_url,
            emulator.base_url,
            *session_ids,
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
        )
        for _ in range(workers)
    ]
    outputs = await asyncio.gather(*(r.communicate() for r in racers))
    for racer, (_, stderr) in zip(racers, outputs, strict=True):
        assert racer.returncode == 0, stderr.decode()

    calls = await ledger_calls(database_url, session_ids)
    assert len(calls) == SESSIONS * EVERY_CLASS_CALLS
    assert {c.status for c in calls.values()} == {CallStatus.SUBMITTED}
    runs = Counter(CallKey(e.session_id, e.turn_id, e.call_id) for e in read_effects(effects_file))
    rows = await refund_rows(database_url)
    for key, call in calls.items():
        ran = rows[key.call_id] if call.tool_name == "record_refund" else runs[key]
        assert ran == 1, f"{call.tool_name} {key} ran {ran} times with {workers} racing workers"
    received = [r for r in emulator.control.tool_results() if r.session_id in session_ids]
    accepted = Counter((r.session_id, r.turn_id, r.call_id) for r in received if r.outcome == "accepted")
    assert len(accepted) == len(calls)
    assert set(accepted.values()) == {1}
    winners = {e.pid for e in read_effects(effects_file)}
    assert len(winners) >= 1
