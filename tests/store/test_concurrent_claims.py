"""Claims raced by real separate processes, and a stale worker fenced across processes.

Workers are ``python -m tests.store.claimer`` processes (see there); they meet at a barrier
of files so that each step's statements start at the same moment.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from tests.store.claimer import RACE_LEASE_SECONDS, TOOL_NAME, hold_key, race_key
from tests.support.paths import ROOT
from tests.support.polling import eventually
from toolledger.domain.records import Recorded
from toolledger.domain.results import succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.store.ledger import LedgerStore

ROUNDS = 5
STARTUP_TIMEOUT = 30.0
STEP_TIMEOUT = 30.0
START_DELAY = 0.05
"""How far in the future a step's start time is set once every worker is at the barrier."""
HOLD_LEASE_SECONDS = 0.3
SHORT_LEASE = 0.05
AFTER_SHORT_LEASE = 0.2


class RecordRaceError(AssertionError):
    """A worker's ``record`` raised instead of finding the call its rival had just recorded."""


def present(path: Path) -> bool:
    return path.exists()


def publish(path: Path, content: str) -> None:
    """Write a file so that it appears whole: readers never see it half written."""
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(content)
    staged.rename(path)


class Worker:
    """A claimer process: one JSON line out per step; its stderr kept in a file for failures."""

    def __init__(self, process: asyncio.subprocess.Process, stderr: Path) -> None:
        self.process = process
        self.stderr = stderr

    def diagnosis(self) -> str:
        return f"worker {self.process.pid} (exit {self.process.returncode}):\n{self.stderr.read_text()}"

    async def line(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        raw = await asyncio.wait_for(self.process.stdout.readline(), STEP_TIMEOUT)
        if not raw:
            await asyncio.wait_for(self.process.wait(), STEP_TIMEOUT)
            raise AssertionError(f"no output from {self.diagnosis()}")
        parsed: dict[str, Any] = json.loads(raw)
        return parsed

    async def finish(self) -> None:
        returncode = await asyncio.wait_for(self.process.wait(), STEP_TIMEOUT)
        assert returncode == 0, self.diagnosis()

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()  # SIGKILL ends a SIGSTOPped process too
            await self.process.wait()


@asynccontextmanager
async def workers(commands: Sequence[list[str]], logs: Path) -> AsyncIterator[list[Worker]]:
    """Start every command as a claimer process; kill whatever still runs at the end."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started: list[Worker] = []
    try:
        for number, arguments in enumerate(commands):
            stderr = logs / f"worker-{number}.stderr"
            with stderr.open("wb") as sink:
                process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "tests.store.claimer",
                    *arguments,
                    cwd=ROOT,
                    env=env,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=sink,
                )
            started.append(Worker(process, stderr))
        yield started
    finally:
        for worker in started:
            await worker.kill()


class Race:
    """Worker processes taking the same step at the same moment, one step after another."""

    def __init__(self, racers: list[Worker], barrier: Path) -> None:
        self.racers = racers
        self.barrier = barrier
        self.steps = 0

    async def step(self) -> list[dict[str, Any]]:
        step = self.steps
        self.steps += 1
        ready = [self.barrier / f"ready-{step}-{i}" for i in range(len(self.racers))]

        def all_ready() -> bool:
            if all(present(path) for path in ready):
                return True
            for racer in self.racers:
                assert racer.process.returncode is None, f"exited early: {racer.diagnosis()}"
            return False

        await eventually(
            all_ready,
            within=STARTUP_TIMEOUT,
            what="the workers did not reach the barrier in time",
            interval=0.005,
        )
        publish(self.barrier / f"go-{step}", repr(time.time() + START_DELAY))
        return [await racer.line() for racer in self.racers]


@asynccontextmanager
async def racing(
    database_url: str, processes: int, ops: str, session_id: str, tmp_path: Path, lease_seconds: float
) -> AsyncIterator[Race]:
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    commands = [
        [
            "race",
            database_url,
            f"--ops={ops}",
            f"--actor=racer-{i}",
            f"--session={session_id}",
            f"--rounds={ROUNDS}",
            f"--index={i}",
            f"--barrier={barrier}",
            f"--lease-seconds={lease_seconds}",
        ]
        for i in range(processes)
    ]
    async with workers(commands, tmp_path) as racers:
        yield Race(racers, barrier)
        for racer in racers:
            await racer.finish()


async def check_record_step(
    store: LedgerStore, session_id: str, round_number: int, results: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One worker claimed the call, every other saw its row, one audit event. Returns the errors."""
    key = race_key(session_id, round_number)
    errors = [r for r in results if "error" in r]
    answered = [r for r in results if "error" not in r]
    winners = [r["actor"] for r in answered if r["claimed"]]
    assert len(winners) == 1, f"round {round_number}: claimed by {winners}"
    starts = [r["started"] for r in results]
    assert max(starts) - min(starts) < 0.5, "the workers did race"
    for result in answered:
        assert result["arguments_mismatch"] is False
        assert (result["status"], result["lease_token"], result["attempt_count"]) == ("running", 1, 1)
        assert result["lease_owner"] == winners[0], "every worker saw the winner's row"
        assert result["idempotency_key"] == key.idempotency_key
    call = await store.get(key)
    assert call is not None
    assert (call.status, call.lease_token, call.attempt_count) == (CallStatus.RUNNING, 1, 1)
    assert call.lease_owner == winners[0]
    events = await store.events(key)
    assert [(e.kind, e.to_status, e.reason, e.actor) for e in events] == [
        ("transition", "running", "recorded and claimed", winners[0])
    ]
    return errors


async def test_record__two_racing_processes__exactly_one_claims(
    database_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    session_id = f"sess_{uuid.uuid4().hex[:12]}"
    store = LedgerStore(engine, actor="test")
    errors: list[dict[str, Any]] = []

    async with racing(database_url, 2, "record", session_id, tmp_path, RACE_LEASE_SECONDS) as race:
        for round_number in range(ROUNDS):
            errors += await check_record_step(store, session_id, round_number, await race.step())

    assert len(await store.for_session(session_id)) == ROUNDS
    if errors:
        raise RecordRaceError(errors)


async def test_record_and_claim__eight_racing_processes__exactly_one_wins_each_race(
    database_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    """Eight processes record each call at once; then, its lease run out, claim it from unknown at once."""
    session_id = f"sess_{uuid.uuid4().hex[:12]}"
    store = LedgerStore(engine, actor="test")
    errors: list[dict[str, Any]] = []

    async with racing(database_url, 8, "record,claim", session_id, tmp_path, SHORT_LEASE) as race:
        for round_number in range(ROUNDS):
            errors += await check_record_step(store, session_id, round_number, await race.step())
        await asyncio.sleep(AFTER_SHORT_LEASE)
        assert len(await store.expire_leases()) == ROUNDS
        for round_number in range(ROUNDS):
            results = await race.step()
            assert [r for r in results if "error" in r] == []
            winners = [r["actor"] for r in results if r["claimed"]]
            assert len(winners) == 1, f"round {round_number}: claimed by {winners}"
            assert {(r["lease_token"], r["attempt_count"], r["lease_owner"]) for r in results} == {
                (2, 2, winners[0])
            }
            key = race_key(session_id, round_number)
            call = await store.get(key)
            assert call is not None
            assert (call.status, call.lease_token, call.attempt_count) == (CallStatus.RUNNING, 2, 2)
            assert call.lease_owner == winners[0]
            claims = [e for e in await store.events(key) if e.from_status == "unknown"]
            assert [(e.to_status, e.lease_token, e.actor) for e in claims] == [("running", 2, winners[0])]

    if errors:
        raise RecordRaceError(errors)


async def test_record__two_connections_racing_with_large_arguments__one_claims_none_fails(
    engine: AsyncEngine,
) -> None:
    """Storing large arguments (TOAST) takes a while between PostgreSQL's conflict pre-check and
    the index inserts, so two simultaneous records of one call reliably meet in between."""
    stores = (LedgerStore(engine, actor="first"), LedgerStore(engine, actor="second"))
    arguments = {"blob": secrets.token_hex(500_000)}
    session_id = f"sess_{uuid.uuid4().hex[:12]}"
    async with engine.connect(), engine.connect():
        pass  # two pooled connections, ready

    for round_number in range(3):
        key = race_key(session_id, round_number)
        results = await asyncio.gather(
            *(
                store.record(
                    key,
                    tool_name=TOOL_NAME,
                    arguments=arguments,
                    effect_class=EffectClass.IDEMPOTENT,
                    lease_seconds=RACE_LEASE_SECONDS,
                )
                for store in stores
            ),
            return_exceptions=True,
        )
        recorded = [r for r in results if isinstance(r, Recorded)]
        assert len(recorded) == 2, f"round {round_number}: {[repr(r)[:300] for r in results]}"
        assert sorted(r.claimed for r in recorded) == [False, True]
        assert {r.call.lease_token for r in recorded} == {1}


async def test_complete__a_stopped_worker_whose_lease_ran_out_is_fenced_across_processes(
    database_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    session_id = f"sess_{uuid.uuid4().hex[:12]}"
    key = hold_key(session_id)
    go = tmp_path / "go"
    store_b = LedgerStore(engine, actor="worker-b")
    command = [
        "hold",
        database_url,
        "--actor=worker-a",
        f"--session={session_id}",
        f"--lease-seconds={HOLD_LEASE_SECONDS}",
        f"--go={go}",
    ]
    async with workers([command], tmp_path) as [worker_a]:
        claimed = await worker_a.line()
        assert (claimed["step"], claimed["claimed"], claimed["lease_token"]) == ("claimed", True, 1)
        os.kill(worker_a.process.pid, signal.SIGSTOP)  # A pauses mid-handler, lease and all
        try:
            await asyncio.sleep(HOLD_LEASE_SECONDS + 0.2)
            expired = await store_b.expire_leases()
            assert [call.key for call in expired] == [key]
            taken = await store_b.claim(
                key, from_statuses=[CallStatus.UNKNOWN], lease_seconds=30, reason="idempotent re-run"
            )
            assert taken is not None
            assert (taken.lease_token, taken.attempt_count, taken.lease_owner) == (2, 2, "worker-b")
            outcome_b = succeeded(key, "result of worker-b")
            await store_b.complete(key, 2, outcome_b)
        finally:
            os.kill(worker_a.process.pid, signal.SIGCONT)
        publish(go, "go")
        attempt = await worker_a.line()
        await worker_a.finish()

    assert attempt["step"] == "complete"
    assert attempt["outcome"] == "fenced", attempt
    assert attempt["heartbeat"] is False, "A's heartbeat with the old token was refused too"
    call = await store_b.get(key)
    assert call is not None
    assert call.status is CallStatus.SUCCEEDED
    assert call.payload == outcome_b.payload, "the stored result is B's"
    assert (call.lease_token, call.attempt_count, call.lease_owner) == (2, 2, "worker-b")
    events = await store_b.events(key)
    assert [(e.from_status, e.to_status, e.lease_token, e.actor) for e in events] == [
        (None, "running", 1, "worker-a"),
        ("running", "unknown", 1, "worker-b"),
        ("unknown", "running", 2, "worker-b"),
        ("running", "succeeded", 2, "worker-b"),
    ]
