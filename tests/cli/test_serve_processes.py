"""`toolledger serve --processes N`, as users run it (a subprocess): N serve processes that
share the watched sessions on PostgreSQL, every call answered once; a killed one started again;
SIGTERM stops them all; none outlives a supervisor killed with SIGKILL; SQLite refuses N > 1."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from tests.support.polling import eventually
from tests.support.serve_process import TOOLS, ServeProcess, run_cli
from tests.support.workload import read_effects, start_sessions, wait_until_idle
from toolledger.cli import supervisor
from toolledger.domain.records import ReplicaRecord
from toolledger.emulator import EmulatorServer
from toolledger.store.engine import create_engine
from toolledger.store.sessions import SessionStore

SESSIONS = 6
T = TypeVar("T")


async def read_sessions(database_url: str, read: Callable[[SessionStore], Awaitable[T]]) -> T:
    engine = create_engine(database_url)
    try:
        return await read(SessionStore(engine))
    finally:
        await engine.dispose()


async def live_replicas(database_url: str) -> list[ReplicaRecord]:
    return await read_sessions(database_url, SessionStore.live_replicas)


async def holders(database_url: str) -> set[str]:
    return await read_sessions(database_url, SessionStore.holders)


async def two_replicas(database_url: str) -> list[ReplicaRecord]:
    async def registered() -> list[ReplicaRecord] | None:
        replicas = await live_replicas(database_url)
        return replicas if len(replicas) == 2 else None

    return await eventually(registered, within=30.0, what="two serve processes registered")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_serve_processes__share_the_sessions__each_call_answered_once__sigterm_stops_all(
    postgres_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    session_ids = await start_sessions(emulator, SESSIONS)
    assert run_cli("sessions", "watch", *session_ids, database_url=postgres_url).returncode == 0

    with ServeProcess(
        postgres_url, emulator.base_url, tmp_path / "serve.log", extra_args=("--processes", "2")
    ) as serve:
        replicas = await two_replicas(postgres_url)
        pids = {replica.pid for replica in replicas}
        assert serve.pid not in pids, "the supervisor itself serves nothing"
        await wait_until_idle(emulator, session_ids)

        async def both_hold() -> bool:
            return len(await holders(postgres_url)) == 2

        await eventually(both_hold, within=15.0, what="both processes hold sessions")

        serve.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(serve.process.wait, 30) == 0, serve.log()
    assert not any(alive(pid) for pid in pids), "every serve process stopped with the supervisor"

    accepted = emulator.control.accepted_results()
    answered = [payloads for key, payloads in accepted.items() if key[0] in session_ids]
    assert answered
    assert all(len(payloads) == 1 for payloads in answered), "each call answered once"
    effects = [e for e in read_effects(effects_file) if e.session_id in session_ids]
    assert len(effects) == len({(e.session_id, e.call_id) for e in effects}), "each handler ran once"


async def test_serve_processes__a_killed_process_is_started_again(
    postgres_url: str, emulator: EmulatorServer, tmp_path: Path
) -> None:
    with ServeProcess(
        postgres_url, emulator.base_url, tmp_path / "serve.log", extra_args=("--processes", "2")
    ) as serve:
        replicas = await two_replicas(postgres_url)
        victim = replicas[0].pid
        os.kill(victim, signal.SIGKILL)

        async def replaced() -> bool:
            pids = {replica.pid for replica in await live_replicas(postgres_url)}
            return victim not in pids and len(pids) == 2

        await eventually(replaced, within=30.0, what="the killed process replaced")
        assert "was killed (SIGKILL); starting it again" in serve.log()
        serve.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(serve.process.wait, 30) == 0, serve.log()


async def test_serve_processes__none_outlives_a_supervisor_killed_with_sigkill(
    postgres_url: str, emulator: EmulatorServer, tmp_path: Path
) -> None:
    with ServeProcess(
        postgres_url, emulator.base_url, tmp_path / "serve.log", extra_args=("--processes", "2")
    ) as serve:
        replicas = await two_replicas(postgres_url)
        serve.process.kill()
        await asyncio.to_thread(serve.process.wait, 10)
        pids = [replica.pid for replica in replicas]
        await eventually(lambda: not any(alive(pid) for pid in pids), within=20.0, what="children gone")


def test_serve_processes__on_sqlite_more_than_one_is_refused_in_one_line(sqlite_url: str) -> None:
    result = run_cli("serve", "--tools", TOOLS, "--processes", "2", database_url=sqlite_url)
    assert result.returncode == 2, result.stderr
    assert "--processes above 1 needs PostgreSQL" in result.stderr
    assert "Traceback" not in result.stderr


def test_supervisor__a_child_that_ignores_sigterm__is_killed_once_its_grace_is_over() -> None:
    """A stop always ends: a serve process still running past its grace period (and the
    margin) is killed, and its calls are taken over as after a crash."""
    child = subprocess.Popen(  # what a serve stuck at exit would look like to the supervisor
        [sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"ignoring SIGTERM\n"
        child.send_signal(signal.SIGTERM)
        started = time.monotonic()
        codes = supervisor._wait_all([supervisor._Child(0, [], child)], within=1.0)
        took = time.monotonic() - started
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert codes == [-signal.SIGKILL]
    assert took < 10.0


IGNORES_SIGTERM = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ignoring SIGTERM', flush=True)\n"
    "time.sleep(60)\n"
)
