"""A SQLite ledger write whose task is cancelled mid-statement, then cancelled again while
SQLAlchemy is closing the connection (as `serve` does at shutdown: a task cancelled directly
and through the task awaiting it), must not leave the file's write lock behind. Before the
stores ran their operations to completion, it did: aiosqlite forgot the connection with its
transaction open and every other writer waited out the 30 s busy timeout."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
from sqlalchemy.engine import make_url

from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.store.engine import create_engine, run_to_completion
from toolledger.store.ledger import LedgerStore

ROUNDS = 60


def can_write(url: str) -> bool:
    """Another process's view: can a writer get in within a second?"""
    connection = sqlite3.connect(str(make_url(url).database), timeout=1.0, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        connection.close()


async def test_sqlite_writes__cancelled_twice_mid_statement__leave_no_write_lock(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    store = LedgerStore(engine, actor="test")
    try:
        completed = 0
        for round_ in range(ROUNDS):
            key = CallKey("sess_cancel", f"turn_{round_}", "call_1")
            write = asyncio.create_task(
                store.record(
                    key,
                    tool_name="charge",
                    arguments={"amount": round_},
                    effect_class=EffectClass.IDEMPOTENT,
                    lease_seconds=30,
                )
            )
            # Land the cancellations at different moments of the statement's life.
            for _ in range(round_ % 6):
                await asyncio.sleep(0)
            write.cancel()
            await asyncio.sleep(0)
            write.cancel()
            try:
                await write
                completed += 1
            except asyncio.CancelledError:
                pass
            assert await asyncio.to_thread(can_write, sqlite_url), f"round {round_}: write lock left held"
            call = await store.get(key)
            # A write cancelled after it started still ends whole: recorded and claimed, or not at all.
            assert call is None or (call.status is CallStatus.RUNNING and call.lease_token == 1)
        assert completed < ROUNDS, "no cancellation ever landed: the test proves nothing"
    finally:
        await engine.dispose()


async def test_run_to_completion__cancelled__finishes_the_operation_then_delivers_the_cancellation() -> None:
    finished = asyncio.Event()

    async def operation() -> str:
        await asyncio.sleep(0.05)
        finished.set()
        return "done"

    task = asyncio.create_task(run_to_completion(operation()))
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set(), "cancelled before the operation finished"


async def test_run_to_completion__not_cancelled__returns_the_result_and_raises_its_errors() -> None:
    async def ok() -> int:
        return 7

    async def broken() -> int:
        raise ValueError("boom")

    assert await run_to_completion(ok()) == 7
    with pytest.raises(ValueError, match="boom"):
        await run_to_completion(broken())


async def test_run_to_completion__cancelled_then_the_operation_fails__the_caller_is_cancelled() -> None:
    async def failing_later() -> int:
        await asyncio.sleep(0.05)
        raise ValueError("boom")

    task = asyncio.create_task(run_to_completion(failing_later()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
