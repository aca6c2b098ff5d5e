"""`toolledger reconcile` passes in other processes, again and again, while `serve` works
the same sessions: a call under a live lease is never posted by the reconciler, only stored
bytes are ever sent, and every call is accepted exactly once."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

from tests.service.history import assert_history, create_refunds_table, wait_quiescent
from tests.service.serve_process import TOOLS, ServeProcess, run_cli
from tests.service.workload import start_sessions
from toolledger.emulator import EmulatorServer, Script

SESSIONS = 6
PASSES = 6


async def test_reconcile_passes__racing_a_running_service__post_nothing_twice(
    postgres_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    await create_refunds_table(postgres_url)
    script = Script.of_calls(
        [("charge", {"amount": 10, "pause_ms": 1500}), ("notify", {"message": "paid", "pause_ms": 1500})],
        [("record_refund", {"cents": 5}), ("ship", {"parcel": "P1"}), ("lookup", {"order_id": "A1"})],
        [("charge", {"amount": 5, "pause_ms": 1500})],
    )
    session_ids = await start_sessions(emulator, SESSIONS, script)
    assert run_cli("sessions", "watch", *session_ids, database_url=postgres_url).returncode == 0

    summaries = []
    with ServeProcess(postgres_url, emulator.base_url, tmp_path / "serve.log") as serve:
        await asyncio.to_thread(serve.wait_serving)
        for _ in range(PASSES):
            done = await asyncio.to_thread(
                run_cli,
                "reconcile",
                "--tools",
                TOOLS,
                "--json",
                database_url=postgres_url,
                base_url=emulator.base_url,
            )
            assert done.returncode == 0, done.stderr
            summaries.append(json.loads(done.stdout))
        states = await wait_quiescent(emulator, postgres_url, session_ids)

    figures = await assert_history(emulator, postgres_url, session_ids, states, effects_file, 6)
    assert figures["calls"] == SESSIONS * 6
    received = [r for r in emulator.control.tool_results() if r.session_id in session_ids]
    outcomes = Counter(r.outcome for r in received)
    assert outcomes["rejected"] == 0, f"a reconciler posted something the session refused: {outcomes}"
    assert all(s["errors"] == 0 for s in summaries)
    met = Counter[str]()
    for summary in summaries:
        met.update(summary["actions"])
    assert met["running_elsewhere"] > 0, f"the passes never met a call under a live lease: {met}"
