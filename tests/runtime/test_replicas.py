"""Several `toolledger serve` replicas on one PostgreSQL ledger, as real subprocesses: they
share the watched sessions fairly, take over the sessions of a replica that was SIGKILLed or
paused once its session leases ran out, get them back at once from one stopped by SIGTERM,
and never run a call twice whatever happened to the replica that started it.

The killed or paused replica is caught inside two handlers at once: an at_most_once `charge`
(which must never run again) and an idempotent `notify` (which may, and must, to finish its
session). Half of the sessions start with each, so every replica runs both side by side."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import pytest
from sqlalchemy import select

from tests.support.history import ledger_calls, wait_quiescent
from tests.support.polling import eventually
from tests.support.serve_process import FAST_ENVIRONMENT, ServeProcess, run_cli
from tests.support.workload import (
    AT_MOST_ONCE_TOOLS,
    CALLS_PER_SESSION,
    Effect,
    assert_exactly_once,
    read_effects,
    shop_script,
    start_sessions,
)
from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallEvent, CallRecord
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, Script
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import replicas as replicas_table
from toolledger.store.sessions import SessionStore

T = TypeVar("T")
StartReplicas = Callable[[str, str, int], list[ServeProcess]]

SESSION_LEASE = float(FAST_ENVIRONMENT["TOOLLEDGER_SESSION_LEASE_SECONDS"])
PAUSE_MS = 1000
"""How long every paused handler sleeps: time to signal a replica while it is inside one."""
JUST_STARTED = 0.4
"""A handler first seen this recently (the effects file is polled every 50 ms) is still
well inside its pause."""
TAKE_OVER_WITHIN = SESSION_LEASE + 6.0
"""A dead replica's sessions are followed again a few seconds after its leases ran out
(renewal ticks, a loaded machine)."""


def charge_first() -> Script:
    """The shop script with pauses: charge + lookup, notify, charge + notify."""
    return shop_script(pause_ms=PAUSE_MS)


def notify_first() -> Script:
    """The same five calls, the paused notify first: notify, charge + lookup, charge + notify."""
    return Script.of_calls(
        [("notify", {"message": "paid", "pause_ms": PAUSE_MS})],
        [("charge", {"amount": 10, "pause_ms": PAUSE_MS}), ("lookup", {"order_id": "A1"})],
        [("charge", {"amount": 5, "pause_ms": PAUSE_MS}), ("notify", {"message": "done"})],
    )


# ----------------------------------------------------------------------- helpers


@pytest.fixture
async def sessions_store(postgres_url: str) -> AsyncIterator[SessionStore]:
    """The `sessions` and `replicas` tables of the test's ledger, read from this process."""
    engine = create_engine(postgres_url)
    yield SessionStore(engine)
    await engine.dispose()


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[StartReplicas]:
    """Starts `serve` replicas; every one is SIGKILLed at teardown, whatever happened."""
    with ExitStack() as stack:

        def start(database_url: str, base_url: str, count: int) -> list[ServeProcess]:
            return [
                stack.enter_context(ServeProcess(database_url, base_url, tmp_path / f"replica-{n}.log"))
                for n in range(count)
            ]

        yield start


async def start_replicas(
    replicas: StartReplicas, store: SessionStore, postgres_url: str, emulator: EmulatorServer, count: int
) -> tuple[list[ServeProcess], dict[int, str]]:
    """Replicas serving; and pid -> replica id of each, from the `replicas` table."""
    processes = replicas(postgres_url, emulator.base_url, count)
    for process in processes:
        await asyncio.to_thread(process.wait_serving)

    async def all_live() -> dict[int, str] | None:
        live = {r.pid: r.replica_id for r in await store.live_replicas()}
        return live if set(live) == {p.pid for p in processes} else None

    return processes, await eventually(all_live, within=5.0, what="every replica in `replicas`")


async def start_mixed_sessions(emulator: EmulatorServer, count: int) -> list[str]:
    """``count`` sessions, alternately charge-first and notify-first: watched in this order,
    each replica's fair share holds as many of one kind as of the other."""
    charging = await start_sessions(emulator, count // 2, charge_first())
    notifying = await start_sessions(emulator, count // 2, notify_first())
    return [s for pair in zip(charging, notifying, strict=True) for s in pair]


async def owners(store: SessionStore) -> dict[str, str | None]:
    """Watched session -> the replica holding an unexpired lease on it (None: nobody)."""
    now = datetime.now(UTC)
    return {
        r.session_id: r.owner
        if r.owner and r.lease_expires_at is not None and r.lease_expires_at > now
        else None
        for r in await store.find(watched=True)
    }


async def owned_by_all(
    store: SessionStore, session_ids: list[str], replica_ids: set[str], at_least: int = 1
) -> dict[str, str] | None:
    """Ownership, once every session is owned and every replica owns ``at_least`` of them."""
    found = await owners(store)
    if any(found.get(s) is None for s in session_ids):
        return None
    owned = {s: o for s, o in found.items() if o is not None}
    counts = Counter(owned.values())
    if set(counts) != replica_ids or min(counts.values()) < at_least:
        return None
    return owned


def watch(session_ids: list[str], database_url: str) -> None:
    watched = run_cli("sessions", "watch", *session_ids, database_url=database_url)
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.count(": watched") == len(session_ids), watched.stdout


async def watch_here(store: SessionStore, session_ids: list[str]) -> None:
    """As `toolledger sessions watch` does (in this order), without its start-up time."""
    for session_id in session_ids:
        assert await store.watch(session_id)


async def replica_rows(store: SessionStore) -> list[str]:
    """Every row of the `replicas` table, expired or not."""
    async with store.engine.connect() as conn:
        return [row.replica_id for row in await conn.execute(select(replicas_table))]


def call_of(effect: Effect) -> CallKey:
    return CallKey(effect.session_id, effect.turn_id, effect.call_id)


def actor_of(replica_id: str) -> str:
    """The name a replica writes the ledger's audit trail under (its worker id)."""
    return replica_id.rsplit("/", 1)[0]


class HandlerWatch:
    """The handlers started since it was made, and when this test first saw each one."""

    def __init__(self, effects_file: Path) -> None:
        self.effects_file = effects_file
        self.first_seen: dict[Effect, float] = {e: -math.inf for e in read_effects(effects_file)}

    async def inside_charge_and_notify(self) -> tuple[Effect, Effect] | None:
        """A replica that has just started both a paused `charge` and a paused `notify` (a
        session's first), so is inside both: the pair, else None."""
        now = time.monotonic()
        effects = read_effects(self.effects_file)
        for effect in effects:
            self.first_seen.setdefault(effect, now)
        first_notify: dict[str, Effect] = {}
        for effect in effects:
            if effect.tool == "notify":
                first_notify.setdefault(effect.session_id, effect)
        fresh = [e for e in effects if now - self.first_seen[e] <= JUST_STARTED]
        for charge in (e for e in fresh if e.tool == "charge" and e.attempt == 1):
            for notify in (e for e in fresh if e in first_notify.values() and e.attempt == 1):
                if charge.pid == notify.pid:
                    return charge, notify
        return None


async def ledger_record(postgres_url: str, key: CallKey) -> tuple[CallRecord, list[CallEvent]]:
    engine = create_engine(postgres_url)
    try:
        ledger = LedgerStore(engine, actor="test")
        call = await ledger.get(key)
        assert call is not None, f"{key} not in the ledger"
        return call, await ledger.events(key)
    finally:
        await engine.dispose()


async def check_every_call(
    emulator: EmulatorServer,
    postgres_url: str,
    session_ids: list[str],
    states: dict[str, str],
    effects_file: Path,
    may_wait: set[str],
) -> None:
    """Each call is answered exactly once with one unchanging payload after running at least
    once; or it is an at_most_once call cut off by the signalled replica, left `unknown`, never
    answered, run at most once. Only sessions in ``may_wait`` may be left waiting on one."""
    calls = await ledger_calls(postgres_url, session_ids)
    effects = [e for e in read_effects(effects_file) if e.session_id in session_ids]
    runs = Counter(call_of(e) for e in effects)
    received = [r for r in emulator.control.tool_results() if r.session_id in session_ids]
    accepted = Counter(
        CallKey(r.session_id, r.turn_id, r.call_id) for r in received if r.outcome == "accepted"
    )
    payloads: dict[CallKey, set[str]] = {}
    for r in received:
        payloads.setdefault(CallKey(r.session_id, r.turn_id, r.call_id), set()).add(
            json.dumps(r.payload, sort_keys=True)
        )

    assert {s for s, state in states.items() if state != "idle"} <= may_wait
    assert set(accepted) <= set(calls), "a call answered that the ledger never recorded"
    for key, call in calls.items():
        if call.tool_name in AT_MOST_ONCE_TOOLS:
            assert runs[key] <= 1, f"{key} ({call.tool_name}) ran {runs[key]} times"
        assert len(payloads.get(key, ())) <= 1, f"{key}: the result changed between submissions"
        if call.status is CallStatus.UNKNOWN:
            assert call.tool_name in AT_MOST_ONCE_TOOLS, f"{key}: only at_most_once calls stay unknown"
            assert key.session_id in may_wait, f"{key}: unknown in a session nobody disturbed"
            assert states[key.session_id] == "waiting_for_operator"
            assert accepted[key] == 0, f"{key}: unknown yet answered"
        else:
            assert call.status is CallStatus.SUBMITTED, f"{key} ended {call.status}"
            assert accepted[key] == 1, f"{key} answered {accepted[key]} times"
            assert runs[key] >= 1, f"{key} answered without running"
    idle = [s for s, state in states.items() if state == "idle"]
    assert_exactly_once(emulator, idle, effects_file, CALLS_PER_SESSION)


# ------------------------------------------------------------------------- tests


async def test_replicas__one_sigkilled_mid_load__survivors_take_over_and_nothing_runs_twice(
    postgres_url: str,
    emulator: EmulatorServer,
    effects_file: Path,
    sessions_store: SessionStore,
    replicas: StartReplicas,
) -> None:
    processes, ids = await start_replicas(replicas, sessions_store, postgres_url, emulator, 3)
    session_ids = await start_mixed_sessions(emulator, 12)
    watch(session_ids, postgres_url)
    await eventually(
        lambda: owned_by_all(sessions_store, session_ids, set(ids.values()), at_least=4),
        within=10.0,
        what="the 12 sessions shared 4 / 4 / 4 by the 3 replicas",
    )

    handlers = HandlerWatch(effects_file)
    charge, notify = await eventually(
        handlers.inside_charge_and_notify, within=20.0, what="a replica inside `charge` and `notify`"
    )
    [victim] = [p for p in processes if p.pid == charge.pid]
    victim.kill()
    survivors = {ids[p.pid] for p in processes if p is not victim}
    # Its leases, expiring on the database's clock.
    expiring = {
        r.session_id: r.lease_expires_at
        for r in await sessions_store.find(watched=True)
        if r.owner == ids[victim.pid] and r.lease_expires_at is not None
    }
    orphans = set(expiring)
    assert {charge.session_id, notify.session_id} <= orphans
    new_leases: dict[str, datetime] = {}

    async def taken_over() -> bool:
        for r in await sessions_store.find(watched=True):
            if r.session_id in orphans and r.owner in survivors and r.lease_expires_at is not None:
                new_leases.setdefault(r.session_id, r.lease_expires_at)
        return set(new_leases) == orphans

    await eventually(taken_over, within=TAKE_OVER_WITHIN, what=f"{sorted(orphans)} taken over")
    # The dead replica is provably gone (its liveness lock went with it): its sessions are
    # taken without waiting for its leases to run out (a paused replica's are not:
    # tests/runtime/test_recovery_speed.py).
    assert any("gone (liveness lock free)" in p.log() for p in processes if p is not victim)
    await eventually(
        lambda: owned_by_all(sessions_store, session_ids, survivors, at_least=4),
        within=TAKE_OVER_WITHIN,
        what="all 12 sessions followed by the 2 survivors",
    )

    states = await wait_quiescent(emulator, postgres_url, session_ids, within=30.0)
    await check_every_call(emulator, postgres_url, session_ids, states, effects_file, may_wait=orphans)
    effects = read_effects(effects_file)
    # The `charge` cut off by the kill had started (its effect is on record) but its outcome
    # is unknown: it is never run again, never answered, and its session waits for an operator.
    assert [e.pid for e in effects if call_of(e) == call_of(charge)] == [victim.pid]
    cut_off, trail = await ledger_record(postgres_url, call_of(charge))
    assert cut_off.status is CallStatus.UNKNOWN
    assert any(e.to_status == "unknown" and "is gone" in (e.reason or "") for e in trail)
    assert [r for r in emulator.control.tool_results(charge.session_id) if r.call_id == charge.call_id] == []
    assert states[charge.session_id] == "waiting_for_operator"
    # The `notify` cut off by the kill ran again (idempotent) on a survivor, which carried its
    # session to the end (through another `charge`).
    reruns = [e for e in effects if call_of(e) == call_of(notify)]
    assert [e.attempt for e in reruns] == [1, 2]
    assert reruns[1].pid in {p.pid for p in processes if p is not victim}
    assert states[notify.session_id] == "idle"

    report = json.loads(run_cli("status", "--json", database_url=postgres_url).stdout)
    assert {r["replica_id"] for r in report["replicas"]} == survivors
    assert sum(r["sessions"] for r in report["replicas"]) == 12
    assert report["unowned_sessions"] == 0


async def test_replicas__two_replicas_six_idle_sessions__three_each_then_sigterm_hands_all_over_at_once(
    postgres_url: str,
    emulator: EmulatorServer,
    effects_file: Path,
    sessions_store: SessionStore,
    replicas: StartReplicas,
) -> None:
    (staying, leaving), ids = await start_replicas(replicas, sessions_store, postgres_url, emulator, 2)
    session_ids = await start_sessions(emulator, 6, Script())
    await watch_here(sessions_store, session_ids)

    shared = await eventually(
        lambda: owned_by_all(sessions_store, session_ids, set(ids.values()), at_least=3),
        within=10.0,
        what="6 sessions shared 3 / 3 by 2 replicas",
    )
    assert Counter(shared.values()) == {ids[staying.pid]: 3, ids[leaving.pid]: 3}

    assert leaving.terminate() == 0, leaving.log()
    left_at = time.monotonic()
    # Given back on the way out: not one lease of the stopped replica is left to run out.
    after = await sessions_store.find(watched=True)
    assert [r.session_id for r in after if r.owner == ids[leaving.pid]] == []
    assert await replica_rows(sessions_store) == [ids[staying.pid]]

    await eventually(
        lambda: owned_by_all(sessions_store, session_ids, {ids[staying.pid]}, at_least=6),
        within=2 * SESSION_LEASE,
        what="the remaining replica owns all 6",
    )
    took = time.monotonic() - left_at
    assert took < SESSION_LEASE, f"took {took:.2f}s: as if waiting for the leases to expire"
    assert "shutting down (signal received)" in leaving.log()
    assert staying.process.poll() is None


async def test_replicas__replica_paused_past_its_session_lease__resumes_without_running_anything_twice(
    postgres_url: str,
    emulator: EmulatorServer,
    effects_file: Path,
    sessions_store: SessionStore,
    replicas: StartReplicas,
) -> None:
    processes, ids = await start_replicas(replicas, sessions_store, postgres_url, emulator, 2)
    session_ids = await start_mixed_sessions(emulator, 4)
    await watch_here(sessions_store, session_ids)
    await eventually(
        lambda: owned_by_all(sessions_store, session_ids, set(ids.values()), at_least=2),
        within=10.0,
        what="4 sessions shared 2 / 2 by 2 replicas",
    )

    # Freeze a replica inside a `charge` and a `notify`, handlers and all.
    handlers = HandlerWatch(effects_file)
    charge, notify = await eventually(
        handlers.inside_charge_and_notify, within=20.0, what="a replica inside `charge` and `notify`"
    )
    [paused] = [p for p in processes if p.pid == charge.pid]
    [other] = [p for p in processes if p is not paused]
    os.kill(paused.pid, signal.SIGSTOP)

    async def notify_rerun_and_charge_unknown() -> bool:
        rerun = any(call_of(e) == call_of(notify) and e.pid == other.pid for e in read_effects(effects_file))
        call, _ = await ledger_record(postgres_url, call_of(charge))
        return rerun and call.status is CallStatus.UNKNOWN

    try:
        # Its session leases run out: the other replica takes its sessions over, finds the
        # calls' leases run out too, runs the `notify` again and leaves the `charge` unknown.
        await eventually(
            lambda: owned_by_all(sessions_store, session_ids, {ids[other.pid]}, at_least=4),
            within=TAKE_OVER_WITHIN,
            what="the paused replica's sessions taken over",
        )
        await eventually(notify_rerun_and_charge_unknown, within=5.0, what="`notify` rerun, `charge` unknown")
    finally:
        # ... and it wakes up while that second `notify` run is inside its pause.
        os.kill(paused.pid, signal.SIGCONT)

    async def noticed() -> bool:
        log = paused.log()
        return "result refused (fenced)" in log and "lease lost (unwatched or taken over)" in log

    await eventually(noticed, within=10.0, what="the paused replica's sessions lost, late result refused")
    states = await wait_quiescent(emulator, postgres_url, session_ids, within=30.0)
    # The `charge`'s one run did finish: its late result was kept and answered, so nothing
    # is left waiting for an operator.
    await check_every_call(emulator, postgres_url, session_ids, states, effects_file, may_wait=set())
    effects = read_effects(effects_file)
    assert [e.pid for e in effects if call_of(e) == call_of(charge)] == [paused.pid]
    charged, trail = await ledger_record(postgres_url, call_of(charge))
    assert (charged.status, charged.attempt_count) == (CallStatus.SUBMITTED, 1)
    [stored] = [e for e in trail if e.to_status == CallStatus.SUCCEEDED.value]
    assert (stored.from_status, stored.actor) == (CallStatus.UNKNOWN.value, actor_of(ids[paused.pid]))
    assert stored.reason == "late result of the only run, after its lease expired"
    # The `notify` ran twice, once per lease, and only the second run's result was stored.
    assert [(e.attempt, e.pid) for e in effects if call_of(e) == call_of(notify)] == [
        (1, paused.pid),
        (2, other.pid),
    ]
    notified, trail = await ledger_record(postgres_url, call_of(notify))
    assert (notified.status, notified.attempt_count) == (CallStatus.SUBMITTED, 2)
    [stored] = [e for e in trail if e.to_status == CallStatus.SUCCEEDED.value]
    assert (stored.actor, stored.lease_token) == (actor_of(ids[other.pid]), notified.lease_token)
    assert paused.process.poll() is None, "the paused replica keeps serving"
    assert other.process.poll() is None
