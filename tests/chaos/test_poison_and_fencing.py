"""Calls that take their process down every time end after a bounded number of attempts
instead of crash-looping the service; a replica paused past its leases (SIGSTOP) and then
resumed (SIGCONT) is fenced out: its late result is refused."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from tests.support.history import ledger_calls
from tests.support.polling import eventually, eventually_sync
from tests.support.serve_process import ServeProcess, run_cli
from tests.support.workload import read_effects, start_sessions, wait_until_idle
from toolledger.domain.results import POISON_MESSAGE
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, Script
from toolledger.settings import Settings

MAX_RESTARTS = 8


async def test_serve__poison_call_of_idempotent_tool__given_up_after_max_attempts(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    [session_id] = await start_sessions(emulator, 1, Script.of_calls([("explode", {})]))
    assert run_cli("sessions", "watch", session_id, database_url=sqlite_url).returncode == 0
    max_attempts = Settings().max_attempts

    kills = 0
    for restart in range(MAX_RESTARTS):  # a supervisor restarting the service after each crash
        with ServeProcess(sqlite_url, emulator.base_url, tmp_path / f"serve-{restart}.log") as serve:
            code = await asyncio.to_thread(_exit_or_quiet, serve, 8.0)
        if code == -signal.SIGKILL:
            kills += 1
            continue
        break

    assert kills == max_attempts, f"{kills} crashes; the call must be given up after {max_attempts}"
    await wait_until_idle(emulator, [session_id])
    [call] = (await ledger_calls(sqlite_url, [session_id])).values()
    assert call.status is CallStatus.SUBMITTED
    [[payload]] = emulator.control.accepted_results(session_id).values()
    assert payload["success"] is False
    assert payload["error"] == POISON_MESSAGE
    assert len(read_effects(effects_file)) == max_attempts


async def test_serve__poison_call_of_at_most_once_tool__crashes_once_then_waits_for_an_operator(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    [session_id] = await start_sessions(emulator, 1, Script.of_calls([("explode_once", {})]))
    assert run_cli("sessions", "watch", session_id, database_url=sqlite_url).returncode == 0

    with ServeProcess(sqlite_url, emulator.base_url, tmp_path / "serve-1.log") as first:
        assert await asyncio.to_thread(first.wait_exit, 30.0) == -signal.SIGKILL
    with ServeProcess(sqlite_url, emulator.base_url, tmp_path / "serve-2.log") as second:
        await asyncio.to_thread(second.wait_serving)

        # Not a fixed sleep then a negative: the service's own word that it looked at the
        # call and chose to wait for an operator (rather than run it again).
        await eventually(
            lambda: "has an unknown outcome" in second.log(),
            within=15,
            what="the service logged that the call has an unknown outcome",
            interval=0.1,
        )
        [call] = (await ledger_calls(sqlite_url, [session_id])).values()
        assert call.status is CallStatus.UNKNOWN
        assert f"toolledger calls resolve {call.key}" in second.log()
        assert second.process.poll() is None, "the service must not crash-loop"

    assert len(read_effects(effects_file)) == 1
    assert not emulator.control.accepted_results(session_id)


def _exit_or_quiet(serve: ServeProcess, quiet_after: float) -> int | None:
    """The exit code if the process dies within ``quiet_after`` seconds of serving, else None."""
    eventually_sync(
        lambda: "serving:" in serve.log() or serve.process.poll() is not None, within=30.0, what=serve.log
    )
    if "serving:" not in serve.log():
        return serve.process.returncode
    try:
        return serve.process.wait(timeout=quiet_after)
    except Exception:
        return None


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [
        pytest.param("notify", {"message": "slow", "pause_ms": 2500}, id="idempotent"),
        pytest.param("charge", {"amount": 1, "pause_ms": 2500}, id="at_most_once"),
    ],
)
async def test_serve__replica_paused_past_its_leases__is_fenced_out_when_resumed(
    tool: str,
    arguments: dict[str, object],
    postgres_url: str,
    emulator: EmulatorServer,
    effects_file: Path,
    tmp_path: Path,
) -> None:
    [session_id] = await start_sessions(emulator, 1, Script.of_calls([(tool, arguments)]))
    assert run_cli("sessions", "watch", session_id, database_url=postgres_url).returncode == 0

    with (
        ServeProcess(postgres_url, emulator.base_url, tmp_path / "first.log") as first,
        ServeProcess(postgres_url, emulator.base_url, tmp_path / "second.log") as second,
    ):
        await asyncio.to_thread(first.wait_serving)
        await eventually(lambda: len(read_effects(effects_file)) == 1, within=20.0, what="the tool ran once")
        [first_run] = read_effects(effects_file)
        stopped, other = (first, second) if first_run.pid == first.pid else (second, first)
        await asyncio.to_thread(other.wait_serving)
        stopped.process.send_signal(signal.SIGSTOP)
        try:
            # Session lease (2 s) and call lease (1 s) run out; the other replica takes the
            # session over and finds the call's outcome unknown: an idempotent tool runs again,
            # an at_most_once one is left for its only run (or an operator).
            if tool == "notify":
                await wait_until_idle(emulator, [session_id], within=30.0)
            else:
                await _until_status(postgres_url, session_id, CallStatus.UNKNOWN)
        finally:
            stopped.process.send_signal(signal.SIGCONT)
        await asyncio.sleep(3.5)  # the resumed replica's handler finishes and tries to store its result
        assert stopped.process.poll() is None
        if tool == "notify":
            assert "fenced" in stopped.log(), "the late result of the superseded run was refused"
        else:
            # Nobody ran it again, so the resumed run's result is the one true outcome.
            await wait_until_idle(emulator, [session_id], within=30.0)

    runs = read_effects(effects_file)
    results = emulator.control.tool_results(session_id)
    [call] = (await ledger_calls(postgres_url, [session_id])).values()
    if tool == "notify":
        assert [r.pid for r in runs] == [stopped.pid, other.pid], "run again by the replica that took over"
        # The paused replica's run was fenced (its result never stored, so never sent). The
        # stored result may go out again as the same request (a replay: same key and body),
        # which the API recognises: one acceptance, the rest replays of it.
        assert results[0].outcome == "accepted", "the paused replica's result never went out"
        assert {r.outcome for r in results[1:]} <= {"replayed"}
        assert len({json.dumps(r.payload, sort_keys=True) for r in results}) == 1
        assert results[0].payload["output"] == "sent slow"
        assert (call.status, call.attempt_count) == (CallStatus.SUBMITTED, 2)
    else:
        assert [r.pid for r in runs] == [stopped.pid], "an at_most_once call is never run again"
        # Both replicas may send the stored bytes (same key): one acceptance, the rest replays.
        assert results[0].outcome == "accepted"
        assert {r.outcome for r in results[1:]} <= {"replayed"}
        assert len({json.dumps(r.payload, sort_keys=True) for r in results}) == 1
        assert (call.status, call.attempt_count) == (CallStatus.SUBMITTED, 1)
        assert results[0].payload["output"] == "charged 1"


async def _until_status(database_url: str, session_id: str, status: CallStatus, within: float = 30.0) -> None:
    async def reached() -> bool:
        calls = await ledger_calls(database_url, [session_id])
        return bool(calls) and all(c.status is status for c in calls.values())

    await eventually(reached, within=within, what=f"every call of {session_id} {status.value}", interval=0.1)
