"""Recovery in seconds: a call running when its `serve` dies is answered soon after a
restart, with the default 30 s leases and a reconcile timer that never fires in the test.

- The dead replica is provably gone (store.liveness): its sessions and calls are taken at
  once, not when their leases run out.
- A call held by a process that cannot be proven gone (a `reconcile --tools` pass, which
  never registers) is taken when its lease runs out: the follower wakes at that moment.
- A replica that is paused, not dead, keeps what it holds until its leases run out; when it
  wakes its token fences it, and its at_most_once call was never run again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.history import ledger_calls
from tests.support.paths import ROOT
from tests.support.serve_process import TOOLS, ServeProcess, run_cli
from tests.support.workload import read_effects, start_sessions
from toolledger.domain.records import CallRecord
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, Script
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore

DEFAULT_TIMERS = {
    # What a user gets without configuring anything; the reconcile timer never fires here,
    # so whatever answers the call, it is not the periodic pass.
    "TOOLLEDGER_LEASE_SECONDS": "30",
    "TOOLLEDGER_SESSION_LEASE_SECONDS": "30",
    "TOOLLEDGER_RECONCILE_INTERVAL_SECONDS": "600",
}
PATIENCE = 20.0
"""Well under the 30 s lease: an answer within it cannot have waited for the lease."""


async def _one_call_session(
    emulator: EmulatorServer, database_url: str, tool: str, **arguments: object
) -> str:
    (session_id,) = await start_sessions(emulator, 1, Script.of_calls([(tool, dict(arguments))]))
    watched = run_cli("sessions", "watch", session_id, database_url=database_url)
    assert watched.returncode == 0, watched.stderr
    return session_id


async def _answered_at(emulator: EmulatorServer, session_id: str, within: float) -> float:
    """When the session's one call got its accepted result (the emulator's clock)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        accepted = [r for r in emulator.control.tool_results(session_id) if r.outcome == "accepted"]
        if accepted:
            return accepted[0].received_at
        await asyncio.sleep(0.05)
    raise TimeoutError(f"session {session_id}: no result accepted within {within:.0f}s")


async def _renew_until(database_url: str, held: CallRecord, seen: Callable[[], bool]) -> float:
    """Renew ``held``'s lease (a few seconds at a time, with its token) until ``seen()``; then
    let it run out. When it runs out (epoch seconds, the database's clock)."""
    engine = create_engine(database_url)
    try:
        store = LedgerStore(engine, actor="holder")
        async with asyncio.timeout(PATIENCE):
            while True:
                assert await store.heartbeat(held.key, held.lease_token, 3.0), "the lease was taken early"
                if seen():
                    break
                await asyncio.sleep(0.2)
        renewed = await store.get(held.key)
    finally:
        await engine.dispose()
    assert renewed is not None
    assert renewed.lease_expires_at is not None
    return renewed.lease_expires_at.timestamp()


async def _only_call(database_url: str, session_id: str) -> CallRecord:
    (call,) = (await ledger_calls(database_url, [session_id])).values()
    return call


def _submitted(call: CallRecord) -> bool:
    return call.status is CallStatus.SUBMITTED


async def _wait_for(
    database_url: str, session_id: str, check: Callable[[CallRecord], bool], within: float = 30.0
) -> CallRecord:
    deadline = time.monotonic() + within
    while True:
        calls = await ledger_calls(database_url, [session_id])
        if calls:
            (call,) = calls.values()
            if check(call):
                return call
        if time.monotonic() > deadline:
            raise TimeoutError(f"session {session_id}: the call never got there ({calls})")
        await asyncio.sleep(0.05)


async def _serve_killed_inside_its_handler(database_url: str, base_url: str, log: Path) -> None:
    """A `serve` with the default timers, armed to SIGKILL itself inside the first handler."""
    with ServeProcess(
        database_url, base_url, log, crash_at="inside_handler", settings=DEFAULT_TIMERS
    ) as crashing:
        code = await asyncio.to_thread(crashing.wait_exit, 60.0)
    assert code == -signal.SIGKILL, crashing.log()


async def test_serve_sigkilled_inside_a_call__restarted_at_once__answered_in_seconds(
    database_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    session_id = await _one_call_session(emulator, database_url, "notify", message="hello")
    await _serve_killed_inside_its_handler(database_url, emulator.base_url, tmp_path / "serve-1.log")
    held = await _only_call(database_url, session_id)
    assert held.status is CallStatus.RUNNING, "the dead process held the call under a live lease"

    restarted_at = time.time()
    with ServeProcess(
        database_url, emulator.base_url, tmp_path / "serve-2.log", settings=DEFAULT_TIMERS
    ) as restarted:
        answered_at = await _answered_at(emulator, session_id, PATIENCE)
        call = await _wait_for(database_url, session_id, _submitted)
        log = restarted.log()

    waited = answered_at - restarted_at
    assert waited < PATIENCE, f"answered {waited:.1f}s after the restart"
    assert "gone (liveness lock free)" in log, log
    assert call.attempt_count == 2, call
    runs = [e for e in read_effects(effects_file) if e.call_id == call.key.call_id]
    assert [e.attempt for e in runs] == [1, 2], "idempotent: run again with the same key, once"


def _reconcile_crashing_inside_handler(database_url: str, base_url: str, lease_seconds: float) -> int:
    """A `toolledger reconcile --tools` pass that claims the call and dies inside its handler."""
    env = {
        **os.environ,
        "TOOLLEDGER_DATABASE_URL": database_url,
        "TOOLLEDGER_OPENAI_BASE_URL": base_url,
        "TOOLLEDGER_LEASE_SECONDS": str(lease_seconds),
        "TOOLLEDGER_CRASH_AT": "inside_handler",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-m", "toolledger.cli", "reconcile", "--tools", TOOLS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    return done.returncode


async def test_call_held_by_an_unregistered_process__taken_when_its_lease_runs_out__not_at_the_timer(
    database_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    lease = 8.0
    session_id = await _one_call_session(emulator, database_url, "notify", message="hello")
    code = await asyncio.to_thread(_reconcile_crashing_inside_handler, database_url, emulator.base_url, lease)
    assert code == -signal.SIGKILL
    held = await _only_call(database_url, session_id)
    assert held.status is CallStatus.RUNNING

    with ServeProcess(
        database_url, emulator.base_url, tmp_path / "serve.log", settings=DEFAULT_TIMERS
    ) as serve:
        # The holder's lease is renewed (as its heartbeat would) until serve has found the call
        # running under it: the premise held by that event, not by how fast this machine is.
        expiry = await _renew_until(database_url, held, lambda: "running_elsewhere" in serve.log())
        answered_at = await _answered_at(emulator, session_id, PATIENCE)
        call = await _wait_for(database_url, session_id, _submitted)
        log = serve.log()

    # Not proven gone (it never registered as a replica): the lease was waited out, and the
    # follower looked again right when it ran out, not 600 s later.
    assert answered_at >= expiry, f"answered {expiry - answered_at:.1f}s before the lease ran out"
    assert answered_at - expiry < 3.0, f"answered {answered_at - expiry:.1f}s after the lease ran out"
    assert "running_elsewhere" in log, log
    assert "looking again in" in log, log
    # Said at start-up: what it waits for, and until when.
    assert "recovery: 1 call(s) run under live leases of other processes" in log, log
    assert call.attempt_count == 2, call


@pytest.mark.parametrize("backend", ["postgres"])
async def test_paused_replica__not_taken_over_before_its_leases_run_out__fenced_when_it_wakes(
    backend: str,
    request: pytest.FixtureRequest,
    emulator: EmulatorServer,
    effects_file: Path,
    tmp_path: Path,
) -> None:
    database_url: str = request.getfixturevalue(f"{backend}_url")
    timers = {
        # The other replica must look while the paused one's call leases still run, however
        # slowly it starts on a loaded machine.
        "TOOLLEDGER_LEASE_SECONDS": "12",
        "TOOLLEDGER_SESSION_LEASE_SECONDS": "2",
        "TOOLLEDGER_RECONCILE_INTERVAL_SECONDS": "600",
    }
    (session_id,) = await start_sessions(
        emulator,
        1,
        Script.of_calls(
            [("notify", {"message": "m", "pause_ms": 4000}), ("charge", {"amount": 7, "pause_ms": 4000})]
        ),
    )
    assert run_cli("sessions", "watch", session_id, database_url=database_url).returncode == 0

    paused = ServeProcess(database_url, emulator.base_url, tmp_path / "paused.log", settings=timers)
    try:
        # Both handlers are mid-run (their effects are written first) when the replica stops.
        deadline = time.monotonic() + 30
        while len([e for e in read_effects(effects_file) if e.session_id == session_id]) < 2:
            assert time.monotonic() < deadline, paused.log()
            await asyncio.sleep(0.02)
        paused.process.send_signal(signal.SIGSTOP)
        held = await ledger_calls(database_url, [session_id])
        tokens = {key: call.lease_token for key, call in held.items()}
        assert all(call.status is CallStatus.RUNNING for call in held.values())

        with ServeProcess(database_url, emulator.base_url, tmp_path / "other.log", settings=timers) as other:
            # The other replica gets the session (its lease is short) and looks at the calls
            # while their leases are live: the paused replica still holds its lock, so it is
            # not gone, and nothing is taken.
            deadline = time.monotonic() + 30
            while "running_elsewhere" not in other.log():
                assert time.monotonic() < deadline, other.log()
                await asyncio.sleep(0.05)
            still = await ledger_calls(database_url, [session_id])
            assert {k: (c.status, c.lease_token) for k, c in still.items()} == {
                k: (CallStatus.RUNNING, t) for k, t in tokens.items()
            }, "taken over from a replica that was only paused"
            assert "gone (liveness lock free)" not in other.log()

            # Its leases run out: the idempotent call is run again, the at_most_once one is
            # left unknown, never run again.
            by_tool = {c.tool_name: c for c in still.values()}
            notify = by_tool["notify"]
            charge = by_tool["charge"]
            store_engine = create_engine(database_url)
            try:
                store = LedgerStore(store_engine, actor="test")
                deadline = time.monotonic() + 30
                while True:
                    now_notify = await store.get(notify.key)
                    now_charge = await store.get(charge.key)
                    assert now_notify is not None
                    assert now_charge is not None
                    if now_notify.status is CallStatus.SUBMITTED and now_charge.status is CallStatus.UNKNOWN:
                        break
                    assert time.monotonic() < deadline, (now_notify, now_charge, other.log())
                    await asyncio.sleep(0.1)
                assert now_notify.lease_token == tokens[notify.key] + 1
                assert now_charge.lease_token == tokens[charge.key], "at_most_once: never claimed again"
                # The operator is told, with the command that settles it.
                assert f"toolledger calls resolve {charge.key}" in other.log(), other.log()

                # The paused replica wakes: its idempotent result is refused by its token; its
                # at_most_once result is the one true outcome of the only run.
                paused.process.send_signal(signal.SIGCONT)
                deadline = time.monotonic() + 30
                while "result refused (fenced)" not in paused.log():
                    assert time.monotonic() < deadline, paused.log()
                    await asyncio.sleep(0.1)
                answered = await store.get(charge.key)
                while answered is not None and answered.status is CallStatus.UNKNOWN:
                    assert time.monotonic() < deadline, paused.log()
                    await asyncio.sleep(0.1)
                    answered = await store.get(charge.key)
                assert answered is not None
                assert answered.status in (
                    CallStatus.SUCCEEDED,
                    CallStatus.SUBMITTED,
                )
            finally:
                await store_engine.dispose()
    finally:
        paused.process.send_signal(signal.SIGCONT)
        paused.kill()

    charges = [e for e in read_effects(effects_file) if e.tool == "charge" and e.session_id == session_id]
    assert len(charges) == 1, f"at_most_once ran {len(charges)} times"
    accepted = [r for r in emulator.control.tool_results(session_id) if r.outcome == "accepted"]
    assert {r.call_id for r in accepted} <= {notify.key.call_id, charge.key.call_id}
    assert len({r.call_id for r in accepted if r.call_id == notify.key.call_id}) == 1


async def test_sqlite_paused_serve__no_other_serve_can_take_its_calls(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    """On SQLite the proof of death is the serve lock: a paused serve still holds it, so no
    other serve starts, and no reconcile pass takes what it holds."""
    session_id = await _one_call_session(emulator, sqlite_url, "notify", message="m", pause_ms=3000)
    paused = ServeProcess(sqlite_url, emulator.base_url, tmp_path / "paused.log", settings=DEFAULT_TIMERS)
    try:
        held = await _wait_for(sqlite_url, session_id, lambda c: c.status is CallStatus.RUNNING)
        paused.process.send_signal(signal.SIGSTOP)
        with ServeProcess(
            sqlite_url, emulator.base_url, tmp_path / "other.log", settings=DEFAULT_TIMERS
        ) as other:
            code = await asyncio.to_thread(other.wait_exit, 30.0)
        assert code != 0
        assert "already served" in other.log()
        still = await _only_call(sqlite_url, session_id)
        assert (still.status, still.lease_token) == (CallStatus.RUNNING, held.lease_token)
        paused.process.send_signal(signal.SIGCONT)
        await _answered_at(emulator, session_id, PATIENCE)
        call = await _wait_for(sqlite_url, session_id, _submitted)
    finally:
        paused.process.send_signal(signal.SIGCONT)
        paused.kill()
    assert call.attempt_count == 1, "run once, by its owner"


async def test_peer_replica_sigkilled__its_sessions_and_calls_taken_by_the_other_in_seconds(
    postgres_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    """No restart at all: the surviving replica takes over, well before the 30 s leases."""
    dying = ServeProcess(
        postgres_url,
        emulator.base_url,
        tmp_path / "dying.log",
        crash_at="inside_handler",
        settings=DEFAULT_TIMERS,
    )
    with (
        dying,
        ServeProcess(postgres_url, emulator.base_url, tmp_path / "peer.log", settings=DEFAULT_TIMERS) as peer,
    ):
        await asyncio.gather(asyncio.to_thread(dying.wait_serving), asyncio.to_thread(peer.wait_serving))
        # Two sessions, one each (a fair share): the dying replica dies inside its call.
        session_ids = await start_sessions(emulator, 2, Script.of_calls([("notify", {"message": "m"})]))
        assert run_cli("sessions", "watch", *session_ids, database_url=postgres_url).returncode == 0
        code = await asyncio.to_thread(dying.wait_exit, 60.0)
        died_at = time.time()
        assert code == -signal.SIGKILL, dying.log()
        answered = [await _answered_at(emulator, s, PATIENCE) for s in session_ids]
        log = peer.log()
    assert max(answered) - died_at < PATIENCE
    assert "gone (liveness lock free)" in log, log


async def test_unknown_call_with_a_deadline__given_up_when_it_passes__not_at_the_timer(
    database_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    session_id = await _one_call_session(emulator, database_url, "hold_funds", cents=5)
    await _serve_killed_inside_its_handler(database_url, emulator.base_url, tmp_path / "serve-1.log")
    with ServeProcess(
        database_url, emulator.base_url, tmp_path / "serve-2.log", settings=DEFAULT_TIMERS
    ) as restarted:
        await _answered_at(emulator, session_id, PATIENCE)
        call = await _wait_for(database_url, session_id, _submitted)
        log = restarted.log()
    assert f"toolledger calls resolve {call.key}" in log, log
    assert "unknown_deadline" in log
    (result,) = [r for r in emulator.control.tool_results(session_id) if r.outcome == "accepted"]
    assert result.payload["success"] is False, "a fixed failure, never a second run"
    assert call.attempt_count == 1
    assert len([e for e in read_effects(effects_file) if e.call_id == call.key.call_id]) == 1


async def test_failed_submission__sent_again_after_a_short_backoff__not_at_the_timer(
    database_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    session_id = await _one_call_session(emulator, database_url, "lookup", order_id="A1")
    emulator.control.fail_submissions(1, status=500, session_id=session_id)
    with ServeProcess(
        database_url,
        emulator.base_url,
        tmp_path / "serve.log",
        TOOLLEDGER_SUBMIT_ATTEMPTS="1",  # the gateway gives up at once: the ledger must retry
        settings=DEFAULT_TIMERS,
    ) as serve:
        await _answered_at(emulator, session_id, PATIENCE)
        call = await _wait_for(database_url, session_id, _submitted)
        log = serve.log()
    outcomes = [r.outcome for r in emulator.control.tool_results(session_id)]
    assert outcomes[-1] == "accepted"
    assert len(outcomes) >= 2, f"the failed try is on record first: {outcomes}\n{log}"
    assert call.attempt_count == 1
