"""One hung handler must not stall the service (issue 30), on SQLite and PostgreSQL, against
the emulator over HTTP with the real SDK.

Hung handlers block until the test creates a file (``hang``, ``hang_again`` in
tests.support.service_tools), created at the end of every test whatever happens. Every wait is
for an event (a file, a ledger state, the service's own status), never a sleep of fixed length;
the few bounds on time are generous and far below what the stall cost (tens of seconds, or for
ever).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from tests.support.history import ledger_calls
from tests.support.polling import eventually
from tests.support.serve_process import ServeProcess, run_cli
from tests.support.service_harness import running_service
from tests.support.workload import read_effects, start_sessions, wait_until_idle
from toolledger.domain.records import CallRecord
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, Script
from toolledger.runtime.service import Service
from toolledger.store.engine import create_engine
from toolledger.store.sessions import SessionStore

HUNG = 8
"""Hung sync handlers: more than the 6 threads of asyncio's default executor on 2 CPUs,
where sync handlers used to run."""
ANSWERED_WITHIN = 15.0
"""A new call's answer, with handlers hung beside it: about a second normally; the stall made
it tens of seconds, or never."""


@pytest.fixture
def release(tmp_path: Path) -> Iterator[Path]:
    """The file hung handlers wait for: created at the end, so no thread outlives the test."""
    path = tmp_path / "release"
    yield path
    let_go(path)


def let_go(release: Path) -> None:
    """Release every handler hanging on ``release``."""
    release.touch()


@asynccontextmanager
async def service_with_hangs(
    database_url: str, emulator: EmulatorServer, release: Path, **overrides: Any
) -> AsyncIterator[Service]:
    """The service; hung handlers released before it stops, even when the test fails (a
    stall would otherwise keep the stop itself from reaching the database)."""
    async with running_service(database_url, emulator, **overrides) as service:
        try:
            yield service
        finally:
            let_go(release)


def hang_script(release: Path, tool: str = "hang") -> Script:
    return Script.of_calls([(tool, {"until_file": str(release)})])


def effects_of(effects_file: Path, tool: str) -> list[str]:
    return [e.session_id for e in read_effects(effects_file) if e.tool == tool]


async def call_of(database_url: str, session_id: str) -> CallRecord | None:
    calls = await ledger_calls(database_url, [session_id])
    return next(iter(calls.values()), None)


async def watch_all(service: Service, session_ids: list[str]) -> None:
    for session_id in session_ids:
        await service.watch(session_id)


# ------------------------------------------------------------------------ threads


async def test_hung_sync_handlers__a_new_async_and_a_new_sync_call_are_still_answered_in_seconds(
    database_url: str, emulator: EmulatorServer, effects_file: Path, release: Path
) -> None:
    async with service_with_hangs(database_url, emulator, release) as service:
        hung = await start_sessions(emulator, HUNG, hang_script(release))
        await watch_all(service, hung)
        # All of them hang at once: each has a thread of its own.
        await eventually(
            lambda: len(effects_of(effects_file, "hang")) == HUNG,
            within=30,
            what=lambda: f"{HUNG} hung handlers running; ran {effects_of(effects_file, 'hang')}",
        )
        load = service.status().handlers
        assert load is not None
        assert (load.threads_busy, load.waiting_for_thread) == (HUNG, 0)

        started = time.monotonic()
        fresh = await start_sessions(emulator, 1, Script.of_calls([("lookup", {"order_id": "A1"})]))
        fresh += await start_sessions(emulator, 1, Script.of_calls([("tick", {"n": 1})]))
        await watch_all(service, fresh)
        # New sessions mean new event streams: new connections, whose host names asyncio
        # resolves on its default executor (where sync handlers used to hang).
        await wait_until_idle(emulator, fresh, within=ANSWERED_WITHIN)
        took = time.monotonic() - started

        for session_id, output in zip(fresh, ["order A1: shipped", "tick 1"], strict=True):
            [payloads] = emulator.control.accepted_results(session_id).values()
            assert [p["output"] for p in payloads] == [output]
        assert not any(emulator.control.accepted_results(s) for s in hung), "still hung, unanswered"

        let_go(release)
        await wait_until_idle(emulator, hung, within=30)

    assert took < ANSWERED_WITHIN
    assert sorted(effects_of(effects_file, "hang")) == sorted(hung), "each hung handler ran once"
    for session_id in hung:
        [payloads] = emulator.control.accepted_results(session_id).values()
        assert [p["output"] for p in payloads] == ["released"]


async def test_every_handler_slot_taken__a_new_call_is_recorded_and_claimed_at_once_and_keeps_its_lease(
    database_url: str, emulator: EmulatorServer, effects_file: Path, release: Path
) -> None:
    async with service_with_hangs(database_url, emulator, release, max_concurrent_calls=2) as service:
        hung = await start_sessions(emulator, 2, hang_script(release))
        await watch_all(service, hung)
        await eventually(lambda: len(effects_of(effects_file, "hang")) == 2, within=30, what="2 hung")

        [waiting] = await start_sessions(emulator, 1, Script.of_calls([("lookup", {"order_id": "B2"})]))
        await service.watch(waiting)

        async def claimed() -> CallRecord | None:
            call = await call_of(database_url, waiting)
            return call if call is not None and call.status is CallStatus.RUNNING else None

        # Recorded and claimed though no slot is free (it used to wait, unrecorded, for a slot).
        first = await eventually(claimed, within=ANSWERED_WITHIN, what="the new call recorded and claimed")
        await eventually(
            lambda: (load := service.status().handlers) is not None and load.waiting_for_slot == 1,
            within=10,
            what=lambda: f"a call waiting for a slot: {service.status().handlers}",
        )
        assert first.lease_expires_at is not None
        # Its lease (1 s here) is renewed while it waits, as a running call's is: three times
        # over, and never taken over (no second claim, not unknown).
        renewed = first.lease_expires_at

        async def renewed_past(moment: datetime) -> CallRecord | None:
            call = await claimed()
            assert call is not None, "the waiting call lost its lease"
            return call if call.lease_expires_at is not None and call.lease_expires_at > moment else None

        for _ in range(3):
            renewal = await eventually(
                functools.partial(renewed_past, renewed), within=10, what="its lease renewed"
            )
            assert renewal.lease_expires_at is not None
            renewed = renewal.lease_expires_at
        assert renewal.attempt_count == first.attempt_count == 1
        assert effects_of(effects_file, "lookup") == [], "its handler has not started"

        let_go(release)
        await wait_until_idle(emulator, [*hung, waiting], within=30)

    assert effects_of(effects_file, "lookup") == [waiting]
    [payloads] = emulator.control.accepted_results(waiting).values()
    assert [p["output"] for p in payloads] == ["order B2: shipped"]


def thread_gauges() -> dict[str, float]:
    names = (
        "toolledger_handler_threads_busy",
        "toolledger_handler_threads_timed_out",
        "toolledger_calls_waiting_for_handler_thread",
    )
    return {name: REGISTRY.get_sample_value(name) or 0.0 for name in names}


async def test_threads_all_taken__timed_out_threads_hold_them__a_sync_call_waits__status_and_metrics_say_so(
    database_url: str, emulator: EmulatorServer, effects_file: Path, release: Path
) -> None:
    """Two threads, two handlers that time out (2 s) but go on hanging: their threads stay
    taken, and a new sync call waits for one, past its own timeout, without failing: its
    timeout counts from its start. The service's status, the Prometheus gauges and
    `toolledger status` (from the replica's heartbeat) all show it."""
    before = thread_gauges()
    timeout = 2.0
    async with service_with_hangs(
        database_url, emulator, release, handler_threads=2, handler_timeout_seconds=timeout
    ) as service:
        hung = await start_sessions(emulator, 2, hang_script(release))
        await watch_all(service, hung)

        async def timed_out() -> bool:
            calls = [await call_of(database_url, s) for s in hung]
            return all(c is not None and c.status is CallStatus.SUBMITTED for c in calls)

        await eventually(timed_out, within=30, what="both hung calls timed out and answered")
        for session_id in hung:
            [payloads] = emulator.control.accepted_results(session_id).values()
            assert payloads[0]["success"] is False, "the model was told it failed (timed out)"

        [ticking] = await start_sessions(emulator, 1, Script.of_calls([("tick", {"n": 7})]))
        await service.watch(ticking)
        await eventually(
            lambda: (load := service.status().handlers) is not None and load.waiting_for_thread == 1,
            within=ANSWERED_WITHIN,
            what=lambda: f"the sync call waiting for a thread: {service.status().handlers}",
        )
        load = service.status().handlers
        assert load is not None
        assert (load.threads, load.threads_busy, load.threads_timed_out, load.waiting_for_thread) == (
            2,
            2,
            2,
            1,
        )
        gauges = thread_gauges()
        assert gauges["toolledger_handler_threads_busy"] - before["toolledger_handler_threads_busy"] == 2
        assert (
            gauges["toolledger_handler_threads_timed_out"] - before["toolledger_handler_threads_timed_out"]
            == 2
        )
        assert (
            gauges["toolledger_calls_waiting_for_handler_thread"]
            - before["toolledger_calls_waiting_for_handler_thread"]
        ) == 1

        def replica_handlers() -> dict[str, int] | None:
            result = run_cli("status", "--json", database_url=database_url, timeout=60)
            assert result.returncode == 0, result.stdout + result.stderr
            [replica] = json.loads(result.stdout)["replicas"]
            handlers: dict[str, int] | None = replica["handlers"]
            return handlers if handlers and handlers["waiting_for_thread"] == 1 else None

        handlers = await eventually(
            lambda: asyncio.to_thread(replica_handlers), within=30, what="`toolledger status` shows it"
        )
        assert (handlers["threads"], handlers["threads_busy"], handlers["threads_timed_out"]) == (2, 2, 2)
        text = await asyncio.to_thread(run_cli, "status", database_url=database_url, timeout=60)
        assert "threads 2/2 busy, 2 timed out and still running" in text.stdout, text.stdout

        # Waiting is not running: past its own timeout, it has neither run nor failed.
        claimed = await call_of(database_url, ticking)
        assert claimed is not None
        assert claimed.status is CallStatus.RUNNING
        assert claimed.started_at is not None
        since = time.monotonic()
        await eventually(lambda: time.monotonic() - since > timeout + 0.5, within=10, interval=0.1)
        still = await call_of(database_url, ticking)
        assert still is not None
        assert (still.status, still.attempt_count) == (CallStatus.RUNNING, 1)
        assert effects_of(effects_file, "tick") == []

        let_go(release)  # the timed-out handlers return: their threads free, the call runs
        await wait_until_idle(emulator, [ticking], within=ANSWERED_WITHIN)
        await eventually(
            lambda: (load := service.status().handlers) is not None and load.threads_busy == 0,
            within=10,
            what="every thread given back",
        )

    [payloads] = emulator.control.accepted_results(ticking).values()
    assert [(p["success"], p["output"]) for p in payloads] == [(True, "tick 7")]
    assert effects_of(effects_file, "tick") == [ticking]


# ------------------------------------------------------------------------ SIGTERM

LONG_LEASE = "60"
"""Call leases far longer than the test: what is taken over in seconds was taken because its
replica was provably gone (its liveness lock), not because a lease ran out."""
GRACE = 2.0


async def test_sigterm_with_a_hung_sync_handler__serve_exits_after_its_grace__the_next_replica_takes_over(
    database_url: str, emulator: EmulatorServer, effects_file: Path, release: Path, tmp_path: Path
) -> None:
    settings = {"TOOLLEDGER_LEASE_SECONDS": LONG_LEASE, "TOOLLEDGER_SHUTDOWN_GRACE_SECONDS": str(GRACE)}
    [session_id] = await start_sessions(
        emulator,
        1,
        Script.of_calls(
            [("hang", {"until_file": str(release)}), ("hang_again", {"until_file": str(release)})]
        ),
    )
    engine = create_engine(database_url)
    try:
        with ServeProcess(
            database_url, emulator.base_url, tmp_path / "first.log", settings=settings
        ) as first:
            await asyncio.to_thread(first.wait_serving)
            await SessionStore(engine).watch(session_id)
            await eventually(
                lambda: {"hang", "hang_again"} <= {e.tool for e in read_effects(effects_file)},
                within=30,
                what=lambda: f"both handlers hang:\n{first.log()}",
            )
            calls = await ledger_calls(database_url, [session_id])
            keys = {call.tool_name: key for key, call in calls.items()}

            started = time.monotonic()
            code = await asyncio.to_thread(first.terminate, GRACE + 20)
            took = time.monotonic() - started
            log = first.log()

        assert code == 0, log
        assert took < GRACE + 10, f"exited {took:.1f}s after SIGTERM (grace {GRACE}s)"
        for tool in ("hang", "hang_again"):
            assert f"cut off call {keys[tool]} (tool {tool})" in log, log
        assert "until_file" not in log, "no arguments in the log"
        assert str(release) not in log
        assert "Traceback" not in log

        # Only now are the handlers released: the first process's threads died with it.
        let_go(release)
        with ServeProcess(
            database_url, emulator.base_url, tmp_path / "second.log", settings=settings
        ) as second:
            await asyncio.to_thread(second.wait_serving)

            async def recovered() -> dict[str, CallRecord] | None:
                found = await ledger_calls(database_url, [session_id])
                by_tool = {call.tool_name: call for call in found.values()}
                done = (
                    by_tool["hang"].status is CallStatus.UNKNOWN
                    and by_tool["hang_again"].status is CallStatus.SUBMITTED
                )
                return by_tool if done else None

            # Well within the 60 s leases: taken over because the first replica was gone.
            by_tool = await eventually(recovered, within=20, what=lambda: f"recovery:\n{second.log()}")
            second_log = second.log()
            second_pid = second.pid
        assert "gone (liveness lock free)" in second_log, second_log
    finally:
        await engine.dispose()

    effects = read_effects(effects_file)
    # at_most_once: never run again, left for a person (unknown); idempotent: run again.
    assert [e.pid for e in effects if e.tool == "hang"] == [first.pid]
    assert [e.pid for e in effects if e.tool == "hang_again"] == [first.pid, second_pid]
    assert by_tool["hang"].attempt_count == 1
    [payloads] = emulator.control.accepted_results(session_id).values()
    assert [p["output"] for p in payloads] == ["released again"]
