"""The database goes away under a running `serve`: PostgreSQL restarted (as a crash, then
started again) repeatedly during a workload; a SQLite file locked by another process for a
while. The service survives, reconnects, and loses nothing."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.private_postgres import PrivatePostgres
from tests.support.history import assert_history, create_refunds_table, wait_quiescent
from tests.support.serve_process import ServeProcess, run_cli
from tests.support.workload import every_class_script, start_sessions
from toolledger.emulator import EmulatorServer, Script
from toolledger.store import migrate
from toolledger.store.engine import create_engine
from toolledger.store.exclusive import SQLiteServiceLock
from toolledger.store.liveness import liveness_for
from toolledger.store.sessions import SessionStore

SESSIONS = 6
RESTARTS = 3


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    if not PrivatePostgres.available():
        pytest.fail("PostgreSQL 15 server binaries (initdb, pg_ctl) are needed to restart a database")
    server = PrivatePostgres()
    try:
        server.init()
        server.start()
        migrate.upgrade(server.url)
        yield server
    finally:
        server.destroy()


def paced_script() -> Script:
    """Every effect class, with think time, so the workload spans the restarts."""
    script = every_class_script()
    return script.model_copy(update={"think_seconds": 0.3})


async def test_serve__postgres_restarted_repeatedly_during_workload__survives_and_loses_nothing(
    private_postgres: PrivatePostgres, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    url = private_postgres.url
    await create_refunds_table(url)
    session_ids = await start_sessions(emulator, SESSIONS, paced_script())
    assert run_cli("sessions", "watch", *session_ids, database_url=url).returncode == 0

    with ServeProcess(url, emulator.base_url, tmp_path / "serve.log") as serve:
        await asyncio.to_thread(serve.wait_serving)
        for _ in range(RESTARTS):
            await asyncio.sleep(0.6)
            await asyncio.to_thread(private_postgres.stop, "immediate")
            await asyncio.sleep(1.5)
            await asyncio.to_thread(private_postgres.start)
        states = await wait_quiescent(emulator, url, session_ids, within=60.0)
        assert serve.process.poll() is None, f"serve died:\n{serve.log()}"
    assert "Traceback" not in serve.log(), "an expected outage is one line, not a traceback"

    figures = await assert_history(emulator, url, session_ids, states, effects_file)
    assert figures["answered"] + figures["unknown"] == figures["calls"]


async def test_serve__sqlite_file_locked_by_another_process__waits_and_loses_nothing(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    await create_refunds_table(sqlite_url)
    session_ids = await start_sessions(emulator, 3, paced_script())
    assert run_cli("sessions", "watch", *session_ids, database_url=sqlite_url).returncode == 0
    database = sqlite_url.split("///", 1)[1]

    with ServeProcess(
        sqlite_url, emulator.base_url, tmp_path / "serve.log", TOOLLEDGER_DATABASE_RETRY_SECONDS="60"
    ) as serve:
        await asyncio.to_thread(serve.wait_serving)
        await asyncio.sleep(0.4)
        # Another process takes the write lock for longer than a transition waits for it.
        locker = sqlite3.connect(database, timeout=30, isolation_level=None)
        try:
            locker.execute("BEGIN EXCLUSIVE")
            await asyncio.sleep(3.0)
        finally:
            locker.execute("COMMIT")
            locker.close()
        states = await wait_quiescent(emulator, sqlite_url, session_ids, within=60.0)
        assert serve.process.poll() is None, f"serve died:\n{serve.log()}"

    await assert_history(emulator, sqlite_url, session_ids, states, effects_file)


async def test_liveness__a_postgres_restart_is_not_taken_for_the_death_of_every_replica(
    private_postgres: PrivatePostgres,
) -> None:
    """A restart drops every replica's lock at once; the live ones take theirs again within a
    second. Meanwhile nobody may be called gone, or a short restart would fence every call
    running anywhere."""
    url = private_postgres.url
    holder_engine = create_engine(url)
    holder = liveness_for(holder_engine, "holder/0000aaaa", SQLiteServiceLock(url))
    try:
        await holder.hold()
        await SessionStore(holder_engine).heartbeat_replica(
            holder.holder, hostname="h", pid=1, lease_seconds=30
        )
        private_postgres.stop("immediate")
        private_postgres.start()
        checker_engine = create_engine(url)
        try:
            checker = liveness_for(checker_engine, "checker/0000bbbb", SQLiteServiceLock(url))
            # The holder's lock went with its connection, and it has not taken it again yet.
            assert await checker.gone([holder.holder]) == frozenset()
            await holder.ensure_held()
            assert await checker.gone([holder.holder]) == frozenset()
        finally:
            await checker_engine.dispose()
    finally:
        await holder.release()
        await holder_engine.dispose()
