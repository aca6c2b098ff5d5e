"""Which replicas are provably gone (store.liveness), and taking over their call leases.

A replica is gone when the lock it held for its whole life is free: PostgreSQL drops an
advisory lock with its connection, the kernel drops the SQLite serve lock with its process.
A paused replica keeps its lock; a process that never registered is never called gone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.paths import ROOT
from toolledger.domain.keys import CallKey
from toolledger.domain.results import succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.errors import FencedError
from toolledger.store.engine import create_engine
from toolledger.store.exclusive import SQLiteServiceLock
from toolledger.store.ledger import LedgerStore
from toolledger.store.liveness import LOCK_CLASS, Liveness, liveness_for
from toolledger.store.sessions import SessionStore


@pytest.fixture
def serve_lock(database_url: str) -> Iterator[SQLiteServiceLock]:
    lock = SQLiteServiceLock(database_url)
    yield lock
    lock.release()


def _replica_id(name: str) -> str:
    return f"{name}/{uuid.uuid4().hex[:8]}"


class Holder:
    """A registered replica in its own process."""

    def __init__(self, database_url: str, replica_id: str) -> None:
        self.replica_id = replica_id
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.store.liveness_holder", database_url, replica_id],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.strip() == "held", f"the holder did not start (exit {self.process.poll()})"

    def signal(self, signal_number: int) -> None:
        self.process.send_signal(signal_number)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait(timeout=10)


async def _gone_soon(liveness: Liveness, replica_id: str, within: float = 5.0) -> frozenset[str]:
    """The server notices a closed connection at once, but its backend exits a moment later."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        gone = await liveness.gone([replica_id])
        if gone or loop.time() > deadline:
            return gone
        await asyncio.sleep(0.05)


async def test_postgres__a_replica_is_gone_once_killed__not_while_paused(postgres_url: str) -> None:
    checker_engine = create_engine(postgres_url)
    checker = liveness_for(checker_engine, _replica_id("checker"), SQLiteServiceLock(postgres_url))
    holder = Holder(postgres_url, _replica_id("holder"))
    try:
        assert await checker.gone([holder.replica_id]) == frozenset()
        holder.signal(signal.SIGSTOP)
        # A paused process keeps its connection, and with it its lock: not gone.
        await asyncio.sleep(0.5)
        assert await checker.gone([holder.replica_id]) == frozenset()
        holder.signal(signal.SIGCONT)
        holder.signal(signal.SIGKILL)
        holder.process.wait(timeout=10)
        assert await _gone_soon(checker, holder.replica_id) == {holder.replica_id}
    finally:
        holder.kill()
        await checker_engine.dispose()


async def test_sqlite__registered_replicas_are_gone_only_to_the_holder_of_the_serve_lock(
    sqlite_url: str,
) -> None:
    engine = create_engine(sqlite_url)
    try:
        registered = _replica_id("old-serve")
        await SessionStore(engine).heartbeat_replica(registered, hostname="h", pid=1, lease_seconds=30)
        lock = SQLiteServiceLock(sqlite_url)
        liveness = liveness_for(engine, _replica_id("me"), lock)
        assert await liveness.gone([registered]) == frozenset(), "without the serve lock nothing is proven"
        lock.acquire()
        try:
            assert await liveness.gone([registered, "never-registered"]) == {registered}
        finally:
            lock.release()
    finally:
        await engine.dispose()


async def test_sqlite__a_live_serve_holds_the_lock__so_nobody_else_proves_it_gone(sqlite_url: str) -> None:
    holder = Holder(sqlite_url, _replica_id("serve"))
    engine = create_engine(sqlite_url)
    try:
        lock = SQLiteServiceLock(sqlite_url)
        with pytest.raises(Exception, match="already served"):
            lock.acquire()
        assert await liveness_for(engine, _replica_id("me"), lock).gone([holder.replica_id]) == frozenset()
        holder.kill()
        lock.acquire()
        try:
            liveness = liveness_for(engine, _replica_id("me"), lock)
            assert await liveness.gone([holder.replica_id]) == {holder.replica_id}
        finally:
            lock.release()
    finally:
        holder.kill()
        await engine.dispose()


async def test_never_gone__itself_or_an_unregistered_owner(
    database_url: str, engine: AsyncEngine, serve_lock: SQLiteServiceLock
) -> None:
    me = _replica_id("me")
    liveness = liveness_for(engine, me, serve_lock)
    serve_lock.acquire()
    await liveness.hold()
    try:
        await SessionStore(engine).heartbeat_replica(me, hostname="h", pid=os.getpid(), lease_seconds=30)
        # An old-style owner ("host:pid", no lock ever taken) or a `reconcile` pass: its free
        # lock proves nothing, so it is left to its lease.
        assert await liveness.gone([me, "host:123"]) == frozenset()
    finally:
        await liveness.release()


def _key() -> CallKey:
    return CallKey("sess_live", f"turn_{uuid.uuid4().hex[:8]}", f"call_{uuid.uuid4().hex[:8]}")


async def _running(store: LedgerStore, key: CallKey) -> int:
    recorded = await store.record(
        key, tool_name="notify", arguments={}, effect_class=EffectClass.IDEMPOTENT, lease_seconds=30.0
    )
    assert recorded.claimed
    return recorded.call.lease_token


async def test_expire_leases__takes_the_gone_owners_running_calls_only(engine: AsyncEngine) -> None:
    gone_owner = LedgerStore(engine, actor="worker", owner=_replica_id("gone"))
    live_owner = LedgerStore(engine, actor="worker", owner=_replica_id("live"))
    taker = LedgerStore(engine, actor="worker", owner=_replica_id("taker"))
    taken_key, kept_key, finished_key = _key(), _key(), _key()
    token = await _running(gone_owner, taken_key)
    await _running(live_owner, kept_key)
    finished_token = await _running(gone_owner, finished_key)
    await gone_owner.complete(finished_key, finished_token, succeeded(finished_key, "done"))

    expired = await taker.expire_leases(gone_owners=[gone_owner.owner])

    assert [call.key for call in expired] == [taken_key]
    taken = await taker.get(taken_key)
    kept = await taker.get(kept_key)
    finished = await taker.get(finished_key)
    assert taken is not None
    assert kept is not None
    assert finished is not None
    assert (taken.status, kept.status, finished.status) == (
        CallStatus.UNKNOWN,
        CallStatus.RUNNING,
        CallStatus.SUCCEEDED,
    )
    # The lease ended now, not 30 s from now: an unknown_deadline counts from the take-over.
    remaining = await taker.lease_remaining(kept_key)
    assert remaining is not None
    assert 25 < remaining <= 30
    assert taken.lease_expires_at is not None
    assert kept.lease_expires_at is not None
    assert taken.lease_expires_at < kept.lease_expires_at
    (event,) = [e for e in await taker.events(taken_key) if e.to_status == CallStatus.UNKNOWN.value]
    assert event.reason is not None
    assert f"lease owner {gone_owner.owner} is gone" in event.reason

    # Fencing as at lease expiry: once run again under a new token, the old one is refused.
    claimed = await taker.claim(
        taken_key, from_statuses=[CallStatus.UNKNOWN], lease_seconds=30.0, reason="re-run"
    )
    assert claimed is not None
    assert claimed.lease_token == token + 1
    with pytest.raises(FencedError):
        await gone_owner.complete(taken_key, token, succeeded(taken_key, "late"))


async def test_expire_leases__never_takes_its_own_calls_as_gone(engine: AsyncEngine) -> None:
    store = LedgerStore(engine, actor="worker", owner=_replica_id("me"))
    key = _key()
    await _running(store, key)
    assert await store.expire_leases(key, gone_owners=[store.owner]) == []
    assert await store.running_owners() >= {store.owner}


async def test_lease_remaining__on_the_database_clock(engine: AsyncEngine) -> None:
    store = LedgerStore(engine, actor="worker")
    key = _key()
    await _running(store, key)
    remaining = await store.lease_remaining(key)
    assert remaining is not None
    assert 28 < remaining <= 30
    assert await store.lease_remaining(_key()) is None, "no such call"


async def test_postgres__a_lock_lost_with_its_connection__is_taken_again(postgres_url: str) -> None:
    """A server restart or a cut connection drops the lock of a live replica (it then reads as
    gone, as documented); its timer takes the lock again on a new connection."""
    engine = create_engine(postgres_url)
    holder = liveness_for(engine, _replica_id("holder"), SQLiteServiceLock(postgres_url))
    checker = liveness_for(engine, _replica_id("checker"), SQLiteServiceLock(postgres_url))
    try:
        await holder.hold()
        await SessionStore(engine).heartbeat_replica(holder.holder, hostname="h", pid=1, lease_seconds=30)
        assert await checker.gone([holder.holder]) == frozenset()
        async with engine.connect() as conn:
            # This holder's lock only (other tests' replicas hold theirs on the same server).
            terminated = await conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                    "AND classid = :c AND objid::bigint = (hashtext(:h)::bigint & 4294967295) "
                    "AND objsubid = 2 AND granted"
                ),
                {"c": LOCK_CLASS, "h": holder.holder},
            )
            assert terminated.scalars().all() == [True]
        assert await _gone_soon(checker, holder.holder) == {holder.holder}
        await holder.ensure_held()
        assert await checker.gone([holder.holder]) == frozenset()
    finally:
        await holder.release()
        await engine.dispose()
