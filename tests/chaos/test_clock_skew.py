"""R8, clock skew: a worker whose clock runs ten minutes fast steals nothing early. Leases are
set and compared on the database's clock, so a process's own clock never decides that
another's lease has run out. The skewed process is a real `toolledger reconcile` whose
``time.time`` and ``datetime.now`` are moved forward before toolledger loads."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.executor_harness import pending_actions
from tests.support.serve_process import TOOLS, run_cli
from tests.support.workload import read_effects
from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.emulator import EmulatorServer
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.sessions import SessionStore

SKEW_SECONDS = 600
LEASE_SECONDS = 120  # far shorter than the skew, far longer than the test

FAST_CLOCK = f"""
import datetime as _datetime
import time as _time

_SKEW = {SKEW_SECONDS}
_real_time, _real_time_ns = _time.time, _time.time_ns
_time.time = lambda: _real_time() + _SKEW
_time.time_ns = lambda: _real_time_ns() + _SKEW * 1_000_000_000


class _FastDatetime(_datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return super().now(tz) + _datetime.timedelta(seconds=_SKEW)

    @classmethod
    def utcnow(cls):
        return super().utcnow() + _datetime.timedelta(seconds=_SKEW)


_datetime.datetime = _FastDatetime
"""


def fast_clock(directory: Path) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "sitecustomize.py").write_text(FAST_CLOCK, encoding="utf-8")
    return directory


def clock_of(python_path: Path) -> float:
    probe = "import time, datetime; print(time.time(), datetime.datetime.now().timestamp())"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(python_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    wall, now = (float(x) for x in done.stdout.split())
    assert abs(wall - now) < 5
    return wall


async def held_by_worker_a(
    store: LedgerStore, emulator: EmulatorServer, lease_seconds: float
) -> tuple[CallKey, int]:
    """A watched session whose one pending call worker A (this process) has claimed, its
    handler as good as running: the key and worker A's lease token."""
    session_id, (action,) = await pending_actions(emulator, [("charge", {"amount": 3})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    held = await store.record(
        key,
        tool_name=action.name,
        arguments=action.arguments,
        effect_class=EffectClass.AT_MOST_ONCE,
        lease_seconds=lease_seconds,
    )
    assert held.claimed
    await SessionStore(store.engine).watch(session_id)
    return key, held.call.lease_token


def skewed_reconcile(skewed: Path, database_url: str, emulator: EmulatorServer) -> dict[str, Any]:
    done = run_cli(
        "reconcile",
        "--tools",
        TOOLS,
        "--json",
        database_url=database_url,
        base_url=emulator.base_url,
        python_path=(skewed,),
    )
    assert done.returncode == 0, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


async def test_a_worker_ten_minutes_fast__finds_a_live_lease_live_and_runs_nothing(
    database_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    skewed = fast_clock(tmp_path / "fast-clock")
    assert clock_of(skewed) - time.time() > SKEW_SECONDS - 5, "the skew did not take"
    engine = create_engine(database_url)
    try:
        store = LedgerStore(engine, actor="worker-a")
        key, token = await held_by_worker_a(store, emulator, LEASE_SECONDS)

        summary = skewed_reconcile(skewed, database_url, emulator)

        assert summary["actions"] == {"running_elsewhere": 1}, summary
        call = await store.get(key)
        assert call is not None
        assert call.status is CallStatus.RUNNING, "worker A's live lease was taken"
        assert call.lease_token == token, "a new lease was taken over worker A's"
        assert [e.kind for e in await store.events(key)] == ["transition"], "the trail moved on"
        assert read_effects(effects_file) == [], "the skewed worker ran the handler"
        assert not emulator.control.accepted_results(key.session_id), "the skewed worker answered"
    finally:
        await engine.dispose()


async def test_the_same_worker__a_lease_run_out_on_the_database_clock__is_expired(
    database_url: str, emulator: EmulatorServer, tmp_path: Path
) -> None:
    """The control: the skewed process does expire leases, once the database says so."""
    skewed = fast_clock(tmp_path / "fast-clock")
    engine = create_engine(database_url)
    try:
        store = LedgerStore(engine, actor="worker-a")
        key, _token = await held_by_worker_a(store, emulator, lease_seconds=0.2)
        await asyncio.sleep(0.5)

        skewed_reconcile(skewed, database_url, emulator)

        call = await store.get(key)
        assert call is not None
        assert call.status is CallStatus.UNKNOWN, "an at_most_once call whose worker died is unknown"
    finally:
        await engine.dispose()
